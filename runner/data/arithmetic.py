"""The built-in arithmetic task: deterministic prompts with integer answers.

Every problem ``a op b`` over the operand range is enumerated in a fixed order, then split by a
hash of its text into a training pool and a held-out pool, so the two never overlap whatever
the counts asked for.
"""

from __future__ import annotations

import hashlib
import random

import attrs

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
HELD_OUT_SHARE = 0.2  # share of all problems reserved for the held-out pool


@attrs.frozen
class Problem:
    a: int
    op: str
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> int:
        return OPERATORS[self.op](self.a, self.b)

    @property
    def key(self) -> str:
        return f"{self.a}{self.op}{self.b}"


def held_out_key(key: str) -> bool:
    """Whether the problem of ``key`` is in the held-out pool: a hash of the key below
    ``HELD_OUT_SHARE`` (the built-in tasks split this way, whatever the counts asked for)."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < HELD_OUT_SHARE


def _is_held_out(problem: Problem) -> bool:
    return held_out_key(problem.key)


def problems(
    split: str, count: int, lo: int = 0, hi: int = 20, ops: tuple[str, ...] = ("+", "-"),
    seed: int = 0
) -> list[Problem]:
    """``count`` problems of ``split`` ("train" or "held_out"), deterministic in all arguments.

    Problems are drawn without replacement while the pool lasts, then cycled: a pool of
    ``(hi - lo + 1)**2 * len(ops)`` problems is split ~80/20 between the two splits.
    """
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    for op in ops:
        if op not in OPERATORS:
            raise ValueError(f"unknown operator {op!r}; choose from {sorted(OPERATORS)}")
    pool = [
        p
        for op in ops
        for a in range(lo, hi + 1)
        for b in range(lo, hi + 1)
        if _is_held_out(p := Problem(a, op, b)) == (split == "held_out")
    ]
    if not pool:
        raise ValueError(f"the operand range {lo}..{hi} leaves no {split} problems")
    random.Random(f"arith-{seed}-{split}").shuffle(pool)
    return [pool[i % len(pool)] for i in range(count)]
