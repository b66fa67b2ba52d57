"""The data cursor: where a run is in its data, and the rules for resuming it.

The stream of items is the epochs' orders laid end to end: epoch 0's ``epoch_order``, then
epoch 1's, and so on. A batch of ``n`` items per rank takes the next ``n * world`` positions of
that stream and gives rank ``r`` the positions ``r, r + world, ...`` of them (``order.shard``).
Every rank therefore holds the same cursor ``(epoch, position)``: one saved cursor restores all
ranks, and over an epoch every item reaches exactly one rank.

Resuming recomputes the order array of the cursor's epoch and reads only the items from the
cursor on; items before it are never touched.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Literal, Protocol

import attrs
import numpy as np

from runner.data.order import epoch_order, shard
from runner.errors import Problem, ResumeError
from runner.types import ObsBundle

RESUME_KEY = "data.cursor_resume"
_MIGRATION_HINT = (
    "to continue the model without restoring the data position, set data.cursor_resume=off for "
    "one migration run, then return to auto or strict once it has written a new checkpoint; "
    "to resume exactly, restore the data and seed the checkpoint was written with"
)


def fingerprint_of(parts: Mapping[str, str]) -> str:
    """sha256 (hex) of the parts as canonical JSON: the same parts always give the same digest."""
    text = json.dumps(dict(parts), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@attrs.frozen
class DataCursor:
    """The data position after the last batch: the next item is ``order(epoch)[position]``.

    ``position`` is a position in the global order of the epoch (all ranks together), always
    below the dataset length: a finished epoch is written as the start of the next one.
    """

    epoch: int = attrs.field(validator=attrs.validators.ge(0))
    position: int = attrs.field(validator=attrs.validators.ge(0))
    seed: int
    fingerprint: str

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DataCursor:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _damaged(f"is not JSON ({exc})") from exc
        fields = {"epoch": int, "position": int, "seed": int, "fingerprint": str}
        if not isinstance(raw, dict) or set(raw) != set(fields):
            raise _damaged(f"must be an object with keys {sorted(fields)}", got=raw)
        for name, kind in fields.items():
            if not isinstance(raw[name], kind) or isinstance(raw[name], bool):
                raise _damaged(f"{name} must be {kind.__name__}", got=raw[name])
        try:
            return cls(**raw)
        except ValueError as exc:
            raise _damaged(str(exc), got=raw) from exc


def _damaged(message: str, got: object = None) -> ResumeError:
    extra = {} if got is None else {"got": got}
    return ResumeError([Problem(RESUME_KEY, f"the saved data cursor {message}", **extra,
                                hint="set data.cursor_resume=off to start the data afresh")])


def diff_parts(saved: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """``name old -> new`` for every fingerprint part that differs, in name order."""
    out = []
    for name in sorted(set(saved) | set(now)):
        old, new = saved.get(name), now.get(name)
        if old != new:
            out.append(f"{name} {_short(old)} -> {_short(new)}")
    return out


def _short(value: str | None) -> str:
    if value is None:
        return "(absent)"
    if value == "":
        return "''"
    return value if len(value) <= 40 else value[:16] + "..."


def check_resume(
    saved: DataCursor | None,
    fingerprint_parts_now: Mapping[str, str],
    saved_parts: Mapping[str, str] | None,
    mode: Literal["strict", "auto", "off"],
    *,
    seed: int | None = None,
) -> DataCursor | None:
    """The cursor to resume from, ``None`` to start the data afresh, or a ResumeError.

    - ``off``: always ``None`` (the model continues, the data starts from the beginning);
    - ``auto``: ``None`` when nothing was saved; the saved cursor when it matches; else an error;
    - ``strict``: an error when nothing was saved or it does not match; else the saved cursor.

    A cursor matches when its fingerprint equals ``fingerprint_of(fingerprint_parts_now)`` and,
    when ``seed`` is given, its seed equals it. The error names each part that differs (from
    ``saved_parts``; without them only the two digests can be shown).
    """
    if mode not in ("strict", "auto", "off"):
        raise ValueError(f"mode must be strict, auto or off, got {mode!r}")
    if mode == "off":
        return None
    if saved is None:
        if mode == "auto":
            return None
        raise ResumeError([Problem(
            RESUME_KEY, "the checkpoint has no saved data cursor, which strict resume requires",
            got=mode, hint="set data.cursor_resume=auto to start the data from the beginning "
            "when no cursor was saved, or off to never restore it")])
    now = fingerprint_of(fingerprint_parts_now)
    differences = []
    if saved.fingerprint != now:
        if saved_parts is not None and fingerprint_of(saved_parts) == saved.fingerprint:
            differences = diff_parts(saved_parts, fingerprint_parts_now)
        differences = differences or [f"fingerprint {_short(saved.fingerprint)} -> {_short(now)}"]
    if seed is not None and seed != saved.seed:
        differences.append(f"seed {saved.seed} -> {seed}")
    if differences:
        raise ResumeError([Problem(
            RESUME_KEY, f"the saved data cursor does not match the data now ({mode} resume): "
            + "; ".join(differences), hint=_MIGRATION_HINT)])
    return saved


class IndexStream:
    """This rank's indices, batch after batch, across epochs; see the module docstring.

    Holds the order array of the current epoch only (int64, 8 bytes per item).
    """

    def __init__(self, length: int, *, seed: int, shuffle: bool, rank: int = 0, world: int = 1,
                 fingerprint: str, cursor: DataCursor | None = None) -> None:
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        shard(np.empty(0), rank, world)  # validates rank and world
        self.length, self.seed, self.shuffle = length, seed, shuffle
        self.rank, self.world, self.fingerprint = rank, world, fingerprint
        epoch, position = 0, 0
        if cursor is not None:
            _check_cursor_fits(cursor, seed=seed, fingerprint=fingerprint, length=length)
            epoch, position = cursor.epoch, cursor.position
        self._epoch, self._position = epoch, position
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    @property
    def cursor(self) -> DataCursor:
        """The state after the last batch (the start, before any)."""
        return DataCursor(self._epoch, self._position, self.seed, self.fingerprint)

    def next_indices(self, n: int) -> np.ndarray:
        """The next ``n`` item indices of this rank, shape ``(n,)``; advances the cursor."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        need, pieces = n * self.world, []
        while need:
            order = self._epoch_order()
            take = min(need, self.length - self._position)
            pieces.append(order[self._position:self._position + take])
            self._position += take
            need -= take
            if self._position == self.length:
                self._epoch, self._position = self._epoch + 1, 0
        block = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return shard(block, self.rank, self.world).copy()

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self._epoch:
            self._order = epoch_order(self.length, self.seed, self._epoch, self.shuffle)
            self._order_epoch = self._epoch
        assert self._order is not None
        return self._order


def _check_cursor_fits(cursor: DataCursor, *, seed: int, fingerprint: str, length: int) -> None:
    problems = []
    if cursor.fingerprint != fingerprint:
        problems.append(f"fingerprint {_short(cursor.fingerprint)} -> {_short(fingerprint)}")
    if cursor.seed != seed:
        problems.append(f"seed {cursor.seed} -> {seed}")
    if cursor.position >= length:
        problems.append(f"position {cursor.position} is past the dataset length {length}")
    if problems:
        raise ResumeError([Problem(
            RESUME_KEY, "the data cursor does not fit this data: " + "; ".join(problems),
            hint="pass the cursor through check_resume first; " + _MIGRATION_HINT)])


class DataStream(Protocol):
    """A rank's training data behind a cursor, whatever it yields: a checkpoint saves the
    cursor, and the ranks compare its fingerprint before they train."""

    @property
    def cursor(self) -> DataCursor: ...


class PromptData(DataStream, Protocol):
    """The training data of GRPO, PPO and OPD (``PromptStream``): prompts with the index each
    has in its source."""

    def next_indexed(self, n: int) -> list[tuple[int, ObsBundle]]: ...


class ItemSource(Protocol):
    """What PromptStream needs from a source (PromptSource is one)."""

    shuffle: bool

    def __len__(self) -> int: ...
    def item(self, i: int) -> ObsBundle: ...
    def fingerprint(self) -> str: ...


class PromptStream:
    """Batches of canonical items for one rank, resumable from a DataCursor.

    ``shuffle`` must equal the source's (it is part of the source's fingerprint).
    """

    def __init__(self, source: ItemSource, seed: int, shuffle: bool, rank: int = 0,
                 world: int = 1, cursor: DataCursor | None = None) -> None:
        if shuffle != source.shuffle:
            raise ValueError(f"shuffle={shuffle} but the source was built with "
                             f"data.shuffle={source.shuffle}; the fingerprint covers it")
        self.source = source
        self._indices = IndexStream(len(source), seed=seed, shuffle=shuffle, rank=rank,
                                    world=world, fingerprint=source.fingerprint(), cursor=cursor)

    @property
    def cursor(self) -> DataCursor:
        return self._indices.cursor

    def next_indexed(self, n: int) -> list[tuple[int, ObsBundle]]:
        """The next ``n`` (index, item) pairs of this rank."""
        return [(int(i), self.source.item(int(i))) for i in self._indices.next_indices(n)]

    def next_batch(self, n: int) -> list[ObsBundle]:
        """The next ``n`` items of this rank, crossing epoch boundaries as needed."""
        return [item for _, item in self.next_indexed(n)]
