"""A run that ends before its last step never exits 0.

User code runs inside a rank: datasets, DataPackers, environments, tools, rewards. One that calls
``os._exit(0)`` ends the process at once, without an exception the runner could catch, and the
job would report success with nothing trained; under torchrun its peers would then fail in a
broken collective and be blamed for it. ``exit_guard`` replaces ``os._exit`` while the run is on:
a call from this process prints one line naming the code's file and line (and the rank, where
there are several), then leaves with 1 in place of 0 (another code is kept). A forked child (a
data loader's worker, a subprocess library) keeps the real ``os._exit``.

``sys.exit`` raises ``SystemExit``, which ``runner.launch.entry.guarded`` turns into the same
kind of line. What no Python code can see (a C extension calling ``exit(0)``) is outside both.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType

from runner.errors import safe_line

EXIT_EARLY = 1  # the exit code in place of 0 for a run that ended before its last step


def where(frame: FrameType | None) -> str:
    """``file:line`` of ``frame`` (the caller that asked to exit), "unknown code" if none."""
    if frame is None:
        return "unknown code"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def raised_at(tb: TracebackType | None) -> str:
    """``file:line`` where the exception of traceback ``tb`` was raised (its innermost frame)."""
    found = "unknown code"
    while tb is not None:
        found = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def early_exit_line(call: str, caller: str, prefix: str = "") -> str:
    return safe_line(f"{prefix}error: {call} was called by {caller} before the run finished: "
                     "the run did not complete (the latest complete checkpoint is intact; run "
                     "the same command again to resume)")


@contextmanager
def exit_guard(prefix: str = "") -> Iterator[None]:
    """While inside: ``os._exit`` called in this process prints the early-exit line (``prefix``
    first: "rank N: ") and leaves with ``EXIT_EARLY`` in place of 0."""
    real = os._exit
    owner = os.getpid()

    def guarded_exit(code: int) -> None:
        if os.getpid() != owner:  # a forked child: not the run's process
            real(code)
        caller = where(sys._getframe(1))
        try:
            print(early_exit_line(f"os._exit({code!r})", caller, prefix), file=sys.stderr,
                  flush=True)
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        real(EXIT_EARLY if code == 0 else code)

    os._exit = guarded_exit
    try:
        yield
    finally:
        os._exit = real
