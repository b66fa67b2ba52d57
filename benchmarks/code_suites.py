"""Test suites for the code benchmarks, as ``data.items_fn`` row transforms.

``slow_tests``: every assert of a built-in code task row also sleeps 20 ms in the program's child
process (a deliberately slow test suite: 80 ms more per program).
"""

from __future__ import annotations

from typing import Any

SLEEP_S = 0.02


def slow_tests(row: dict[str, Any]) -> dict[str, Any]:
    lines = row["tests"].splitlines()
    slow = [line.replace("assert ", f"assert __import__('time').sleep({SLEEP_S}) is None and ", 1)
            for line in lines]
    return {**row, "tests": "\n".join(slow)}
