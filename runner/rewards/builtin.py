"""Built-in reward functions: plain ``(completions, items) -> list[float]`` callables."""

from __future__ import annotations

import re
from collections.abc import Sequence

from runner.rewards.code_tests import code_tests, code_tests_all
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


def exact_match(completions: Sequence[str], items: Sequence[ObsBundle]) -> list[float]:
    """1.0 when the completion, stripped and lower-cased, is the item's reference answer (the
    built-in image task's colour names), else 0.0.

    >>> exact_match(["red", " Blue ", "red!"], [ObsBundle("q", "red"), ObsBundle("q", "blue"),
    ...                                         ObsBundle("q", "red")])
    [1.0, 1.0, 0.0]
    """
    return [1.0 if text.strip().lower() == str(item.reference).strip().lower() else 0.0
            for text, item in zip(completions, items, strict=True)]


def final_answer(text: str) -> str:
    r"""The part of ``text`` math-verify should read: after the last ``####`` when there is one
    (the GSM8K answer marker), else all of it (math-verify then finds ``\boxed{}``, a stated
    answer or the last expression).

    >>> final_answer("16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars.\n#### 18")
    '18'
    >>> final_answer(r"so the answer is $\frac{1}{2}$")
    'so the answer is $\\frac{1}{2}$'
    """
    _, marker, tail = text.rpartition("####")
    return tail.strip() if marker else text


def math_verify_reward(completions: Sequence[str], items: Sequence[ObsBundle]) -> list[float]:
    r"""1.0 when the math-verify package finds the completion's answer equal to the reference's
    (numbers, fractions, LaTeX, ``\boxed{}``, ``#### N``), else 0.0; 0.0 too when either has no
    answer it can read.

    math-verify's own signal-based time limits are turned off (they only work in the main
    thread); ``reward.timeout_s`` bounds the call instead.

    >>> items = [ObsBundle("q", "Half of 36 is 18.\n#### 18")] * 4
    >>> math_verify_reward(["She earns 18 dollars. #### 18", r"\boxed{18}", "#### 19", "none"],
    ...                    items)
    [1.0, 1.0, 0.0, 0.0]
    >>> math_verify_reward([r"$\frac{3}{4}$", "0.75", "3/5"], [ObsBundle("q", "3/4")] * 3)
    [1.0, 1.0, 0.0]
    """
    from math_verify import parse, verify

    out = []
    for text, item in zip(completions, items, strict=True):
        gold = parse(final_answer(str(item.reference)), parsing_timeout=None)
        answer = parse(final_answer(text), parsing_timeout=None)
        same = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)
        out.append(1.0 if same else 0.0)
    return out


BUILTIN_REWARDS = {"arithmetic_exact": arithmetic_exact, "format": format_reward,
                   "math_verify": math_verify_reward, "exact_match": exact_match,
                   "code_tests": code_tests, "code_tests_all": code_tests_all}
