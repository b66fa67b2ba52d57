"""``DatasetPreferenceEnv``: the DPO data side. It owns the preference source, the shuffle, rank
sharding, the cursor and the held-out traversal.

Training source, exactly one of ``data.factory``, ``data.jsonl_path``, ``data.tar_path``,
``data.synthetic_pairs``; with none, ``data.count`` built-in arithmetic pairs. Held-out source
(when ``data.validation.enabled``): ``data.validation.factory`` or ``data.validation.jsonl_path``
(capped at ``validation.size``), or, for built-in training pairs, ``validation.size`` pairs of the
arithmetic held-out split. The two are checked not to overlap (by ``membership_ids()``, reading
no item) when the env is built, before any training.

Batches follow the same stream as prompt sources (``runner.data.cursor``): every rank holds the
same cursor, and a resumed env continues exactly where the saved one would have.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from runner.data.cursor import DataCursor, DataStream, IndexStream
from runner.data.membership import check_overlap
from runner.data.order import shard
from runner.data.pairs import (
    PairKeys,
    PairSource,
    PreferencePair,
    factory_pairs,
    file_pairs,
    synthetic_pairs,
)
from runner.errors import Problem, RecipeError
from runner.recipe.schema import DataConfig, Recipe

__all__ = ["DatasetPreferenceEnv", "PreferenceData", "PreferencePair", "build_pair_source"]


class PreferenceData(DataStream, Protocol):
    """DPO's training data (``DatasetPreferenceEnv``): this rank's pairs batch by batch, every
    training pair (to score them all with the reference once) and this rank's held-out pairs."""

    def next_batch(self, n: int) -> list[PreferencePair]: ...
    def training_pairs(self) -> list[PreferencePair]: ...
    def validation_pairs(self) -> list[PreferencePair]: ...


def build_pair_source(data: DataConfig, *, validation: bool = False) -> PairSource:
    """The training (or, with ``validation``, held-out) preference source of ``[data]``.

    Which keys may be combined is checked once, with the recipe (``runner.recipe.checks``):
    this takes a checked ``[data]`` table.
    """
    keys = PairKeys(data.prompt_column, data.chosen_key, data.rejected_key, data.margin_column)
    common = {"shuffle": data.shuffle}
    builtin = {"lo": data.min_operand, "hi": data.max_operand, "ops": tuple(data.operators),
               "rejected": data.synthetic_rejected}
    need_ids = data.validation.enabled
    if not validation:
        if data.factory:
            return factory_pairs(data.factory, data.factory_kwargs, key="data.factory",
                                 split="train", need_ids=need_ids, keys=keys, **common)
        if data.jsonl_path or data.tar_path:
            kind = "jsonl" if data.jsonl_path else "tar"
            return file_pairs(data.jsonl_path or data.tar_path, keys, kind=kind,
                              key=f"data.{kind}_path", split="train", **common,
                              max_member_bytes=data.tar_member_max_bytes,
                              max_total_bytes=data.tar_max_bytes)
        return synthetic_pairs(data.synthetic_pairs or data.count, "train", **builtin,
                               key="data.synthetic_pairs", **common)
    v = data.validation
    if v.factory:
        return factory_pairs(v.factory, v.factory_kwargs, key="data.validation.factory",
                             split="held_out", need_ids=need_ids, limit=v.size, keys=keys,
                             **common)
    if v.jsonl_path:
        return file_pairs(v.jsonl_path, keys, kind="jsonl", key="data.validation.jsonl_path",
                          split="held_out", limit=v.size, **common)
    if not (data.factory or data.jsonl_path or data.tar_path):  # built-in training pairs
        return synthetic_pairs(v.size, "held_out", **builtin, key="data.validation.size",
                               **common)
    train_key = ("data.factory" if data.factory else
                 "data.jsonl_path" if data.jsonl_path else "data.tar_path")
    raise RecipeError([Problem(
        "data.validation", f"validation is on but no held-out set is given for the {train_key} "
        "training source", hint="set data.validation.jsonl_path or data.validation.factory, or "
        "data.validation.enabled=false")])


class DatasetPreferenceEnv:
    """Preference pairs for one rank: ``next_batch(n)``, ``cursor``, ``validation_pairs()``."""

    def __init__(self, data: DataConfig, *, seed: int, rank: int = 0, world: int = 1,
                 cursor: DataCursor | None = None) -> None:
        self.train = build_pair_source(data)
        self.held_out: PairSource | None = None
        if data.validation.enabled:
            self.held_out = build_pair_source(data, validation=True)
            check_overlap(self.train, self.held_out)  # ids only: reads no item
            self.held_out.pair(0)
        self.train.pair(0)  # a broken first item fails here, at setup, not at step 1
        self.rank, self.world = rank, world
        self._seed, self._shuffle = seed, data.shuffle
        self.resume_at(cursor)

    def resume_at(self, cursor: DataCursor | None) -> DatasetPreferenceEnv:
        """Continue the batches from ``cursor`` (None: the start), without reading the sources
        again."""
        self._stream = IndexStream(len(self.train), seed=self._seed, shuffle=self._shuffle,
                                   rank=self.rank, world=self.world,
                                   fingerprint=self.train.fingerprint(), cursor=cursor)
        return self

    @classmethod
    def from_recipe(cls, recipe: Recipe, *, rank: int = 0, world: int = 1,
                    cursor: DataCursor | None = None) -> DatasetPreferenceEnv:
        return cls(recipe.data, seed=recipe.run.seed, rank=rank, world=world, cursor=cursor)

    def __len__(self) -> int:
        return len(self.train)

    @property
    def cursor(self) -> DataCursor:
        """The state after the last batch; save it with the checkpoint."""
        return self._stream.cursor

    def fingerprint_parts(self) -> dict[str, str]:
        return self.train.fingerprint_parts()

    def fingerprint(self) -> str:
        return self.train.fingerprint()

    def next_batch(self, n: int) -> list[PreferencePair]:
        """This rank's next ``n`` training pairs, crossing epoch boundaries as needed."""
        return [self.train.pair(int(i)) for i in self._stream.next_indices(n)]

    def training_pairs(self) -> list[PreferencePair]:
        """Every training pair in index order (not this rank's share: all of them)."""
        return [self.train.pair(i) for i in range(len(self.train))]

    def validation_pairs(self) -> list[PreferencePair]:
        """One pass over the held-out set in index order: this rank's shard of it (so the ranks
        together see every held-out pair exactly once). Empty when validation is off."""
        if self.held_out is None:
            return []
        indices = shard(np.arange(len(self.held_out)), self.rank, self.world)
        return [self.held_out.pair(int(i)) for i in indices]
