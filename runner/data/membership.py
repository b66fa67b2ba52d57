"""Refuse a held-out set that overlaps the training set, from item ids alone.

Both sources give ``membership_ids()``: the built-in prompts their problem keys, file and hub
sources a hash of the raw prompt text, custom sources their own metadata-only hook. The check
compares ids; it never reads or decodes an item.
"""

from __future__ import annotations

import hashlib
import json
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
