"""Refuse a held-out set that overlaps the training set, from item ids alone.

Both sources give ``membership_ids()``: the built-in prompts their problem keys, file and hub
sources a hash of the raw prompt text, custom sources their own metadata-only hook or, for a
prompt source without one, ids from each item's canonical text (``item_id``). The check
compares ids; it never decodes media.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any, Protocol

from runner.errors import Problem, RecipeError

SHOWN_IDS = 5


class HasMembership(Protocol):
    label: str

    def membership_ids(self) -> tuple[str, ...]: ...


def check_overlap(train: HasMembership, held_out: HasMembership) -> None:
    """RecipeError (key ``data.validation``) when any held-out id is also a training id.

    The message gives the number of overlapping held-out ids and the first few, sorted.
    """
    train_ids = set(train.membership_ids())
    shared = sorted({i for i in held_out.membership_ids() if i in train_ids})
    if not shared:
        return
    shown = ", ".join(repr(i) for i in shared[:SHOWN_IDS])
    more = f" and {len(shared) - SHOWN_IDS} more" if len(shared) > SHOWN_IDS else ""
    raise RecipeError([Problem(
        "data.validation", f"{len(shared)} held-out item id(s) of {held_out.label} also appear in "
        f"the training set {train.label}: {shown}{more}",
        hint="use a held-out set disjoint from training (data.validation.factory or "
        "data.validation.path), or set data.validation.enabled=false")])


def text_id(value: Any) -> str:
    """A membership id from item text (or JSON-able content): ``sha256:`` + 24 hex digits."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=repr)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:24]


def item_id(item: Any, *, where: str = "") -> str:
    """A membership id from a canonical item (``ObsBundle``), for sources without their own ids.

    A text-only item: ``text_id`` of its prompt (the id a file source gives the same prompt). An
    item with images or videos: ``text_id`` of the prompt together with each media item's raw
    reference (``media_ref``), so one question about two pictures is two items. Nothing is
    decoded.
    """
    if not item.images and not item.videos:
        return text_id(item.prompt)
    return text_id({"prompt": item.prompt,
                    "images": [media_ref(m, where=where) for m in item.images],
                    "videos": [media_ref(m, where=where) for m in item.videos]})


def media_ref(value: Any, *, where: str = "") -> str:
    """The raw reference of one image or video, without decoding it: a path or URL as written;
    ``sha256:`` of raw bytes; a ``{"path": ...}`` / ``{"bytes": ...}`` mapping (the undecoded
    form ``datasets`` uses) by its path, else its bytes; an object opened from a file (a PIL
    image) by its ``filename``. Anything else is a RecipeError: the source needs its own
    ``membership_ids()``."""
    if isinstance(value, str | os.PathLike):
        return os.fspath(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return "sha256:" + hashlib.sha256(bytes(value)).hexdigest()
    if isinstance(value, Mapping):
        if value.get("path"):
            return str(value["path"])
        if isinstance(value.get("bytes"), bytes | bytearray | memoryview):
            return media_ref(value["bytes"], where=where)
    filename = getattr(value, "filename", None)
    if isinstance(filename, str) and filename:
        return filename
    at = f" in {where}" if where else ""
    raise RecipeError([Problem(
        "data.validation", f"cannot make a membership id for a {type(value).__name__} media "
        f"item{at} without decoding it", hint="keep media as paths or raw bytes in the rows, "
        "or give the dataset a membership_ids() method built from metadata")])
