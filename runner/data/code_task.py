"""The built-in code task: "write ``f(n)``" over small loops, each with four assert tests.

Every problem is a loop over ``i`` from a start ``s`` to ``n`` (inclusive) of one of four kinds::

    Write f(n): the sum of i * 7 for i from 2 to n.
    def f(n):
        return sum(i * 7 for i in range(2, n + 1))

(``times``; ``plus``: ``i + k``; ``square``: ``i * i + k``; ``count``: how many ``i`` are
divisible by ``k``). Its tests call ``f`` on four values of ``n`` (``assert f(9) == 308``). The
classic mistake, ``range(s, n)``, stops one short: it fails every test whose last term is not 0.

Problems are enumerated in a fixed order and split by a hash of their key into a training pool
and a held-out pool (about a fifth, as the arithmetic task is: ``arithmetic.held_out_key``), so
the two never overlap. ``CodeTask`` is the map-style dataset a recipe names as
``data.factory = "runner.data.code_task.train"`` (``held_out`` for
``data.validation.factory``); its rows are ``{"prompt", "tests", "key"}``, the tests one assert
per line, as the ``code_tests`` reward reads them (``data.response_column = "tests"``).
"""

from __future__ import annotations

import random

import attrs

from runner.data.arithmetic import held_out_key

STARTS = (0, 1, 2, 3)
# kind -> the values of k it takes
K_VALUES = {"times": range(2, 31), "plus": range(1, 31), "square": range(0, 31),
            "count": range(2, 10)}
TERMS = {"times": "i * {k}", "plus": "i + {k}", "square": "i * i + {k}"}


@attrs.frozen
class CodeProblem:
    kind: str  # a key of K_VALUES
    k: int
    start: int

    @property
    def key(self) -> str:
        return f"{self.kind}-{self.k}-{self.start}"

    @property
    def question(self) -> str:
        if self.kind == "count":
            return (f"Write f(n): how many i from {self.start} to n are divisible by {self.k}.")
        term = TERMS[self.kind].format(k=self.k)
        return f"Write f(n): the sum of {term} for i from {self.start} to n."

    def program(self, slip: bool = False) -> str:
        """The right program, or with ``slip`` the one whose loop stops one short."""
        end = "n" if slip else "n + 1"
        loop = f"for i in range({self.start}, {end})"
        if self.kind == "count":
            body = f"sum(1 {loop} if i % {self.k} == 0)"
        else:
            body = f"sum({TERMS[self.kind].format(k=self.k)} {loop})"
        return f"def f(n):\n    return {body}"

    def value(self, n: int) -> int:
        """``f(n)``, computed here without running any program."""
        terms = range(self.start, n + 1)
        if self.kind == "count":
            return sum(1 for i in terms if i % self.k == 0)
        if self.kind == "times":
            return sum(i * self.k for i in terms)
        if self.kind == "plus":
            return sum(i + self.k for i in terms)
        return sum(i * i + self.k for i in terms)

    def test_inputs(self) -> list[int]:
        """Four values of ``n``; the last one a multiple of ``k`` from ``start + 2`` on, so the
        ``count`` kind's slip shows too."""
        last = self.k * (1 + (self.start + 2) // max(1, self.k)) if self.k else 12
        return [self.start + 2, 7, 11, last]

    @property
    def tests(self) -> str:
        return "\n".join(f"assert f({n}) == {self.value(n)}" for n in self.test_inputs())


def all_problems() -> list[CodeProblem]:
    return [CodeProblem(kind, k, s) for kind, ks in K_VALUES.items() for k in ks for s in STARTS]


def problems(split: str, count: int, seed: int = 0) -> list[CodeProblem]:
    """``count`` problems of ``split`` ("train" or "held_out") in a seeded order, cycled when
    ``count`` exceeds the pool."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    pool = [p for p in all_problems() if held_out_key(p.key) == (split == "held_out")]
    random.Random(f"code-{seed}-{split}").shuffle(pool)
    return [pool[i % len(pool)] for i in range(count)]


class CodeTask:
    """A map-style dataset of the code task: rows ``{"prompt", "tests", "key"}``."""

    def __init__(self, split: str, count: int, seed: int = 0) -> None:
        self.split, self.count, self.seed = split, count, seed
        self._problems = problems(split, count, seed)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, str]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        p = self._problems[index]
        return {"prompt": p.question, "tests": p.tests, "key": p.key}

    def cursor_fingerprint(self) -> str:
        return f"code-task-v1 split={self.split} count={self.count} seed={self.seed}"

    def membership_ids(self) -> tuple[str, ...]:
        return tuple(p.key for p in self._problems)


def train(count: int = 2000, seed: int = 0) -> CodeTask:
    """The training split (cycled: the pool holds about 300 problems)."""
    return CodeTask("train", count, seed)


def held_out(count: int = 64, seed: int = 0) -> CodeTask:
    """The held-out split (about 75 problems; never in the training split)."""
    return CodeTask("held_out", count, seed)
