"""Reward functions that decide by the item which groups have all-equal rewards, for the
dynamic-sampling tests: whatever the model samples, a group is filtered exactly when its item's
answer (``reference``) matches a rule the test can evaluate on the data alone."""

from __future__ import annotations

from collections.abc import Sequence


def _patterned(items: Sequence, tie) -> list[float]:
    """0 for every completion of an item with ``tie(answer)``; otherwise 0, 1, 0, 1, ... by
    position (groups are adjacent and of even size, so such a group's rewards differ)."""
    return [0.0 if tie(int(item.reference)) else float(i % 2) for i, item in enumerate(items)]


def ties_on_multiples_of_3(completions: Sequence[str], items: Sequence) -> list[float]:
    """Groups of items whose answer is a multiple of 3 have all-equal rewards.

    >>> from types import SimpleNamespace as N
    >>> ties_on_multiples_of_3("abcd", [N(reference="6")] * 2 + [N(reference="7")] * 2)
    [0.0, 0.0, 0.0, 1.0]
    """
    return _patterned(items, lambda a: a % 3 == 0)


def ties_unless_multiple_of_4(completions: Sequence[str], items: Sequence) -> list[float]:
    """Only groups of items whose answer is a multiple of 4 have rewards that differ."""
    return _patterned(items, lambda a: a % 4 != 0)


def always_ties(completions: Sequence[str], items: Sequence) -> list[float]:
    """Every group's rewards are equal (all 1)."""
    return [1.0] * len(completions)
