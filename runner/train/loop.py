"""The step loop shared by every algorithm: eval, metrics, live view, checkpoints, Ctrl-C.

An algorithm supplies ``one_step(step) -> metrics`` and, when it has a held-out set,
``held_out() -> metrics``; this module decides when to evaluate, log and checkpoint.

Ctrl-C (SIGINT) or SIGTERM during the loop asks for a stop: the ranks agree at the end of each
step whether any of them was asked, so all stop after the same step; a checkpoint of it is
written, and ``KeyboardInterrupt`` leaves (the CLI exits 130). A checkpoint is therefore always
a step boundary, never half a step. A second signal stops at once, without a new checkpoint
(earlier ones are untouched).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from runner.errors import ActorDied, NonFiniteUpdate
from runner.train.assemble import RunContext


class AgreedStop(KeyboardInterrupt):
    """Every rank stops after the same step (its checkpoint is written): they may still meet
    in a collective, unlike after a second signal, which stops each rank where it is."""


class StopRequests:
    """Within the block, the first SIGINT / SIGTERM sets ``requested``; a second interrupts.

    Outside the main thread (where signals cannot be caught) only ``request()`` sets it.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, reporter: Any, poll: Callable[[], bool] | None = None) -> None:
        self.reporter = reporter
        self._requested = False
        self.poll = poll
        self._old: dict[int, Any] = {}

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
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def every(step: int, n: int) -> bool:
    return n > 0 and step % n == 0


def run_loop(run: RunContext, one_step: Callable[[int], dict[str, Any]],
             held_out: Callable[[], dict[str, float]] | None,
             save: Callable[[int], Any] | None = None) -> dict[str, Any]:
    recipe, metrics, reporter = run.recipe, run.metrics, run.reporter
    save = save or run.save
    last = recipe.run.max_steps
    step = run.start_step
    if held_out is not None and step == 0:
        metrics.write({"step": 0, **held_out()})
    reporter.start(recipe.run.name, last, step)
    mark = time.perf_counter()
    with StopRequests(reporter, run.stop_poll) as stop:
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
            if run.comm.any(stop.requested):  # every rank stops after the same step
                if not saved:
                    save(step)
                reporter.message(f"stopped after step {step}; the checkpoint is written")
                raise AgreedStop
    return {"step": step}
