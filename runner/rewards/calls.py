"""Calling reward functions: concurrently, each under a time limit, failures named.

Each function of a reward set runs on the whole batch in a worker thread of its own, all started
together, so a slow judge or sandbox does not wait for the others. Threads suit rewards that
wait (on a subprocess, a socket, a server); pure-Python arithmetic gains nothing from them but
loses little. A call that is still running at the deadline cannot be stopped from outside: its
thread is abandoned (a daemon thread, it never blocks the process from exiting) and the step
fails. Code that uses ``signal`` (``signal.alarm`` timeouts) only works in the main thread, so a
single function with no time limit runs in the calling thread.

Which item a failing call was on: the function receives its ``completions`` and ``items`` as
lists that remember the last position read (by index or by iteration); an exception or a
timeout is reported at that position. A function that copies its arguments first has read every
item, so the position is then the last one.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, SupportsIndex

from runner.errors import RewardFailure

RewardFn = Callable[[Sequence[str], Sequence[Any]], Sequence[float]]


class _Reads:
    """The last position either argument list was read at (None before any read)."""

    def __init__(self) -> None:
        self.last: int | None = None


class TrackedList(list):
    """A list that records, in a shared ``_Reads``, the last position read from it."""

    def __init__(self, values: Sequence[Any], reads: _Reads) -> None:
        super().__init__(values)
        self._reads = reads

    def __getitem__(self, index: SupportsIndex | slice) -> Any:  # type: ignore[override]
        value = super().__getitem__(index)
        if isinstance(index, slice):
            positions = range(*index.indices(len(self)))
            if positions:
                self._reads.last = positions[-1]
        else:
            position = index.__index__()
            self._reads.last = position if position >= 0 else len(self) + position
        return value

    def __iter__(self) -> Iterator[Any]:
        for position in range(len(self)):
            self._reads.last = position
            yield super().__getitem__(position)


class _Call:
    def __init__(self, name: str, fn: RewardFn, completions: Sequence[str], items: Sequence[Any]
                 ) -> None:
        self.name, self.fn, self.n = name, fn, len(completions)
        self.reads = _Reads()
        self.args = (TrackedList(completions, self.reads), TrackedList(items, self.reads))
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - user rewards may raise anything,
            # or call sys.exit(): reported below, naming the function
            self.error = exc
        finally:
            self.done = True

    def where(self) -> str:
        last = self.reads.last
        return ("before reading any item" if last is None else
                f"at item {last} of {self.n} (the last item it read)")


def call_all(names: Sequence[str], functions: Sequence[RewardFn], completions: Sequence[str],
             items: Sequence[Any], *, timeout_s: float, step: int | None) -> list[list[float]]:
    """Each function's values for the batch, in order; ``RewardFailure`` naming every function
    that raised, timed out or returned something other than one finite number per completion."""
    calls = [_Call(n, f, completions, items) for n, f in zip(names, functions, strict=True)]
    if len(calls) == 1 and timeout_s <= 0:
        calls[0].run()
    else:
        threads = [threading.Thread(target=c.run, name=f"reward {c.name}", daemon=True)
                   for c in calls]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(None if timeout_s <= 0 else max(0.0, deadline - time.monotonic()))
    failures, values = [], []
    for call in calls:
        if not call.done:
            failures.append((call.name, call.reads.last, f"did not finish within "
                             f"reward.timeout_s = {timeout_s:g} s, {call.where()}; its thread "
                             "is abandoned"))
            continue
        if call.error is not None:
            exc = call.error
            hint = ""
            if isinstance(exc, ValueError) and "main thread" in str(exc):
                hint = " (signal-based timeouts do not work in a worker thread: turn them off " \
                       "and let reward.timeout_s bound the call)"
            failures.append((call.name, call.reads.last, f"raised {type(exc).__name__}: {exc} "
                             f"{call.where()}{hint}"))
            continue
        checked = _check_values(call.result, call.n)
        if isinstance(checked, tuple):
            failures.append((call.name, checked[0], checked[1]))
        else:
            values.append(checked)
    if failures:
        raise RewardFailure(step, failures)
    return values


def _check_values(result: Any, n: int) -> list[float] | tuple[int | None, str]:
    """The values as floats, or (index, why) for the first bad one."""
    try:
        values = list(result)
    except TypeError:
        return None, f"returned a {type(result).__name__}, not a list of {n} numbers"
    if len(values) != n:
        return None, f"returned {len(values)} values for {n} completions"
    out = []
    for index, value in enumerate(values):
        why = not_a_reward(value)
        if why:
            return index, f"returned {_shown(value)} at index {index}: {why}"
        out.append(float(value))
    return out


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: rewards train as float32
# The largest reward in magnitude (each function's value, a weighted total, an episode's env
# reward, and their sum): a group's mean and unbiased variance stay finite in float32 for any
# group the recipe allows (up to 1,048,576 members: 1,048,576 x (2e15)**2 < FLOAT32_MAX).
MAX_REWARD = 1e15
BEYOND_MAX_REWARD = (f"rewards must be at most {MAX_REWARD:g} in magnitude (they train as float32, "
                     "where a group's mean and variance must stay finite); scale the reward down")


def not_a_reward(value: Any) -> str:
    """Why ``value`` cannot be a reward, or "" when it is a real number (of any numeric type:
    Python, numpy, ...) of at most ``MAX_REWARD`` in magnitude."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "a boolean" if isinstance(value, bool) else f"a {type(value).__name__}"
        return f"{kind} is not a number; return int or float values"
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return "it cannot be converted to a float"
    if math.isnan(number):
        return "NaN is not a reward; return a finite number"
    if not abs(number) <= MAX_REWARD:
        return BEYOND_MAX_REWARD
    return ""


def _shown(value: Any) -> str:
    from runner.errors import show_value

    return f"{show_value(value)} ({type(value).__module__}.{type(value).__qualname__})" \
        if type(value).__module__ not in ("builtins",) else show_value(value)
