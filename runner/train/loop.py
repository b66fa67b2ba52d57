"""The step loop shared by every algorithm: eval, metrics, live view, checkpoints, Ctrl-C.

An algorithm supplies ``one_step(step) -> metrics`` and, when it has a held-out set,
``held_out() -> metrics``; this module decides when to evaluate, log and checkpoint.

Ctrl-C (SIGINT) or SIGTERM during the loop asks for a stop: the step under way finishes, a
checkpoint of it is written, and ``KeyboardInterrupt`` leaves (the CLI exits 130). A checkpoint
is therefore always a step boundary, never half a step. A second signal stops at once, without
a new checkpoint (earlier ones are untouched).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from runner.recipe.schema import Recipe
from runner.rewards import RewardSet
from runner.train.rollouts import evaluate
from runner.train.session import PromptRun
from runner.ui import MetricsLog, Reporter


class StopRequests:
    """Within the block, the first SIGINT / SIGTERM sets ``requested``; a second interrupts."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.requested = False
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.reporter.message("stop requested: finishing this step, then writing a checkpoint "
                              "(press Ctrl-C again to stop at once)")

    def __enter__(self) -> StopRequests:
        self._old = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def every(step: int, n: int) -> bool:
    return n > 0 and step % n == 0


def run_loop(recipe: Recipe, start_step: int, metrics: MetricsLog, reporter: Reporter,
             one_step: Callable[[int], dict[str, Any]], save: Callable[[int], Any],
             held_out: Callable[[], dict[str, float]] | None) -> dict[str, Any]:
    last = recipe.run.max_steps
    step = start_step
    if held_out is not None and step == 0:
        metrics.write({"step": 0, **held_out()})
    reporter.start(recipe.run.name, last, step)
    with StopRequests(reporter) as stop:
        while step < last:
            step += 1
            row = {"step": step, **one_step(step)}
            if held_out is not None and (every(step, recipe.train.eval_every) or step == last):
                row.update(held_out())
            if every(step, recipe.logging.every_steps) or step == last:
                metrics.write(row)
            reporter.step(step, row)
            saved = every(step, recipe.checkpoint.every_steps) or step == last
            if saved:
                save(step)
            if stop.requested:
                if not saved:
                    save(step)
                reporter.message(f"stopped after step {step}; the checkpoint is written")
                raise KeyboardInterrupt
    return {"step": step}


def run_prompt_loop(run: PromptRun, one_step: Callable[[int], dict[str, Any]],
                    rewards: RewardSet | None, save: Callable[[int], Any] | None = None,
                    more_held_out: Callable[[], dict[str, float]] | None = None) -> dict[str, Any]:
    """``run_loop`` for the rollout algorithms: held-out greedy accuracy through the engine, plus
    the algorithm's own held-out metrics from ``more_held_out``."""

    def held_out() -> dict[str, float]:
        metrics = evaluate(run.engine, run.rollout_packer, run.val_items, run.recipe.rollout, rewards, 0)
        return metrics | (more_held_out() if more_held_out else {})

    return run_loop(run.recipe, run.start_step, run.metrics, run.reporter, one_step,
                    save or run.save, held_out if run.val_items else None)
