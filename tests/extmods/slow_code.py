"""A ``data.items_fn`` for the code task whose test suite is slow: each program's first test
sleeps 0.1 s in the program's child process, so a step's reward stage lasts long enough to be
interrupted."""

from __future__ import annotations

from typing import Any


def slow_first_test(row: dict[str, Any]) -> dict[str, Any]:
    first, *rest = row["tests"].splitlines()
    slow = first.replace("assert ", "assert __import__('time').sleep(0.1) is None and ", 1)
    return {**row, "tests": "\n".join([slow, *rest])}
