"""Example user extensions: dataset factories a recipe names by dotted path.

Run with the repository root on PYTHONPATH, e.g.::

    [data]
    factory = "examples.posttrain_extensions.build_prompt_dataset"
    factory_kwargs = { count = 1000 }
    prompt_column = "question"
    response_column = "answer"

    [data.validation]
    factory = "examples.posttrain_extensions.build_held_out_prompt_dataset"

Training items use even numbers and held-out items odd ones, so the two never overlap whatever
the counts. Every dataset here is map-style (``len`` and indexing), builds its rows on demand,
and answers ``membership_ids()`` from its own parameters without building any row.
"""

from __future__ import annotations

from typing import Any


class AdditionPrompts:
    """Rows ``{"question": "What is n + 7?", "answer": "n+7"}`` for n = 2*i + parity."""

    def __init__(self, count: int, parity: int) -> None:
        self.count, self.parity = count, parity

    def _n(self, index: int) -> int:
        return 2 * index + self.parity

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, str]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        n = self._n(index)
        return {"question": f"What is {n} + 7?", "answer": str(n + 7), "source": "example"}

    def cursor_fingerprint(self) -> str:
        # Changes whenever what an index means changes: bump the version when the rows change.
        return f"addition-prompts-v1 count={self.count} parity={self.parity}"

    def membership_ids(self) -> tuple[str, ...]:
        return tuple(f"add7-{self._n(i)}" for i in range(self.count))


def build_prompt_dataset(count: int = 100) -> AdditionPrompts:
    """Training prompts (even n)."""
    return AdditionPrompts(count, parity=0)


def build_held_out_prompt_dataset(count: int = 20) -> AdditionPrompts:
    """Held-out prompts (odd n): disjoint from ``build_prompt_dataset`` at any count."""
    return AdditionPrompts(count, parity=1)


def add_instruction(row: dict[str, Any]) -> dict[str, Any]:
    """An ``items_fn``: row in, row out. Set ``data.items_fn`` to this dotted path."""
    return {**row, "question": "Reply with a number only. " + row["question"]}


class AdditionPreferences:
    """DPO items ``(prompt, winner, loser)``: the right sum preferred to a sum that is one off."""

    def __init__(self, count: int, parity: int) -> None:
        self.count, self.parity = count, parity

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[str, str, str]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        n = 2 * index + self.parity
        return f"What is {n} + 7?", str(n + 7), str(n + 8)

    def cursor_fingerprint(self) -> str:
        return f"addition-preferences-v1 count={self.count} parity={self.parity}"

    def membership_ids(self) -> tuple[str, ...]:
        return tuple(f"add7-pair-{2 * i + self.parity}" for i in range(self.count))


def build_preference_dataset(count: int = 100) -> AdditionPreferences:
    """Training preference pairs (even n)."""
    return AdditionPreferences(count, parity=0)


def build_held_out_preference_dataset(count: int = 20) -> AdditionPreferences:
    """Held-out preference pairs (odd n): disjoint from ``build_preference_dataset``."""
    return AdditionPreferences(count, parity=1)


# --- A DataPacker subclass ---------------------------------------------------------------------
# One packer class owns both sides of a model's contract. This one tags every rollout prompt with
# a domain marker; the policy side reuses the engine's prompt ids, so it sees the same marker.

from runner.packers import DataPacker, DecoderOnlyLLMDataPacker  # noqa: E402
from runner.types import ObsBundle  # noqa: E402


class DomainTaggedPacker(DecoderOnlyLLMDataPacker):
    """The decoder-only packer, with ``<domain>`` in front of each rollout prompt."""

    TAG = "<domain>"

    def get_rollout_input(self, item: ObsBundle) -> str:
        return self.TAG + super().get_rollout_input(item)


def build_default_packer() -> DataPacker:
    """Zero-argument packer factory: a fresh instance for each role that asks."""
    return DomainTaggedPacker()
