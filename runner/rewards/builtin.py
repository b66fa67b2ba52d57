"""Built-in reward functions: plain ``(completions, items) -> list[float]`` callables."""

from __future__ import annotations

import re
from collections.abc import Sequence

from runner.types import ObsBundle

_INTEGER = re.compile(r"-?\d+")
_ONLY_INTEGER = re.compile(r"^\s*-?\d+\s*$")


def final_integer(text: str) -> int | None:
    """The last integer in ``text``, or None.

    >>> final_integer("so the answer is -12")
    -12
    >>> final_integer("no digits") is None
    True
    """
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def arithmetic_exact(completions: Sequence[str], items: Sequence[ObsBundle]) -> list[float]:
    """1.0 when the completion's final integer equals the item's reference answer, else 0.0.

    >>> arithmetic_exact(["7", "it is 8", "x"], [ObsBundle("3+4", "7")] * 3)
    [1.0, 0.0, 0.0]
    """
    out = []
    for text, item in zip(completions, items, strict=True):
        value = final_integer(text)
        try:
            ref = int(str(item.reference).strip())
        except ValueError:
            ref = final_integer(str(item.reference))
        out.append(1.0 if value is not None and value == ref else 0.0)
    return out


def format_reward(completions: Sequence[str], items: Sequence[ObsBundle]) -> list[float]:
    """1.0 when the completion is a bare integer (the answer format asked for), else 0.0.

    >>> format_reward(["42", " -3 ", "42 apples"], [ObsBundle("q")] * 3)
    [1.0, 1.0, 0.0]
    """
    return [1.0 if _ONLY_INTEGER.match(text) else 0.0 for text in completions]


BUILTIN_REWARDS = {"arithmetic_exact": arithmetic_exact, "format": format_reward}
