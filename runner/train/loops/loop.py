"""The step loop shared by every algorithm: eval, metrics, live view, checkpoints, Ctrl-C.

An algorithm supplies ``one_step(step) -> metrics`` and, when it has a held-out set,
``held_out() -> metrics``; this module decides when to evaluate, log and checkpoint.

Ctrl-C (SIGINT) or SIGTERM during the loop asks for a stop: the ranks agree at the end of each
step whether any of them was asked, so all stop after the same step; a checkpoint of it is
written, and ``KeyboardInterrupt`` leaves (the CLI exits 130). A checkpoint is therefore always
a step boundary, never half a step. A second signal (SIGINT or SIGTERM alike) stops at once,
without a new checkpoint (earlier ones are untouched), even when the step is stuck inside one
long native call.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from runner.errors import ActorDied, NonFiniteUpdate
from runner.train.assembly.run import RunContext


class AgreedStop(KeyboardInterrupt):
    """Every rank stops after the same step (its checkpoint is written): they may still meet
    in a collective, unlike after a second signal, which stops each rank where it is."""


class StopRequests:
    """Within the block, the first SIGINT / SIGTERM sets ``requested``; a second interrupts.

    Outside the main thread (where signals cannot be caught) only ``request()`` sets it.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    STUCK_S = 3.0  # after a second signal, how long the main thread gets to stop by itself

    def __init__(self, reporter: Any, poll: Callable[[], bool] | None = None) -> None:
        self.reporter = reporter
        self._requested = False
        self.poll = poll
        self._old: dict[int, Any] = {}
        self._watcher: _SignalWatcher | None = None

    @property
    def requested(self) -> bool:
        """A signal asked for a stop, or ``poll`` (the launcher's stop flag) says so."""
        if not self._requested and self.poll is not None and self.poll():
            self._requested = True
            self.reporter.message("stop requested: finishing this step, then writing a "
                                  "checkpoint")
        return self._requested

    def request(self) -> None:
        self._requested = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self._requested:
            raise KeyboardInterrupt
        self._requested = True
        self.reporter.message("stop requested: finishing this step, then writing a checkpoint "
                              "(press Ctrl-C again to stop at once)")

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
            self._watcher = _SignalWatcher.start(self.SIGNALS, self.STUCK_S)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class _SignalWatcher:
    """Sees every SIGINT / SIGTERM the moment it arrives, whatever the main thread is doing.

    Python runs signal handlers in the main thread between bytecodes, so a step stuck in one
    long native call (tokenising a huge prompt) would not see a second signal until the call
    returns. The interpreter's low-level handler also writes each signal's number to the
    wakeup fd; this thread reads it, and when a second stop signal is not acted on within
    ``stuck_s`` (the main thread is stuck), it ends the process with exit code 130, as a
    handled second Ctrl-C does. Earlier checkpoints are untouched (they are written atomically).
    """

    def __init__(self, read: socket.socket, write: socket.socket, old_fd: int,
                 signals: tuple[int, ...], stuck_s: float) -> None:
        self._read, self._write, self._old_fd = read, write, old_fd
        self._signals, self._stuck_s = {int(s) for s in signals}, stuck_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stop signals", daemon=True)

    @classmethod
    def start(cls, signals: tuple[int, ...], stuck_s: float) -> _SignalWatcher | None:
        read, write = socket.socketpair()
        write.setblocking(False)
        try:
            old_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread after all
            read.close()
            write.close()
            return None
        watcher = cls(read, write, old_fd, signals, stuck_s)
        watcher._thread.start()
        return watcher

    def _run(self) -> None:
        seen = 0
        while not self._done.is_set():
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            seen += sum(byte in self._signals for byte in data)
            if seen >= 2 and not self._done.wait(self._stuck_s):
                print("interrupted (a second stop signal; the step did not return, so the "
                      "process ends here)", file=sys.stderr, flush=True)
                os._exit(130)

    def stop(self) -> None:
        self._done.set()
        signal.set_wakeup_fd(self._old_fd)
        self._write.close()  # the reader sees the end and leaves
        self._thread.join(1.0)
        self._read.close()


def every(step: int, n: int) -> bool:
    return n > 0 and step % n == 0


def run_loop(run: RunContext, one_step: Callable[[int], dict[str, Any]],
             held_out: Callable[[], dict[str, float]] | None,
             save: Callable[[int], Any] | None = None) -> dict[str, Any]:
    recipe, metrics, reporter = run.svc.recipe, run.svc.metrics, run.svc.reporter
    save = save or run.save
    last = recipe.run.max_steps
    step = run.state.start_step
    if held_out is not None and step == 0:
        metrics.write({"step": 0, **held_out()})
    reporter.start(recipe.run.name, last, step)
    mark = time.perf_counter()
    with StopRequests(reporter, run.svc.stop_poll) as stop:
        while step < last:
            step += 1
            try:
                row = {"step": step, **one_step(step)}
                if held_out is not None and (every(step, recipe.train.eval_every) or step == last):
                    row.update(held_out())
            except ActorDied as exc:  # a role's actor: say in which step it was lost
                raise ActorDied(f"step {step}: {exc}") from None
            except NonFiniteUpdate as exc:
                if exc.step is not None:
                    raise
                raise NonFiniteUpdate(exc.detail, step=step) from None
            # Wall seconds since the same point of the previous step: everything the loop did
            # (the step, evaluation, the previous step's display, checkpoint and stop check).
            now = time.perf_counter()
            row["time/step"], mark = now - mark, now
            if every(step, recipe.logging.every_steps) or step == last:
                metrics.write(row)
            reporter.step(step, row)
            saved = every(step, recipe.checkpoint.every_steps) or step == last
            if saved:
                save(step)
            if run.svc.comm.any(stop.requested):  # every rank stops after the same step
                if not saved:
                    save(step)
                reporter.message(f"stopped after step {step}; the checkpoint is written")
                raise AgreedStop
    return {"step": step}
