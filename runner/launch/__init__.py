"""Where the rank program runs: one process (``local``), N processes on this machine
(``torchrun``, or an external ``torchrun`` / ``accelerate launch`` detected from the
environment), or N Ray actors (``ray``). An explicit table, no registration by import."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.eval.job import EvalJob
    from runner.ranks.context import RankContext
    from runner.recipe.plan import RunPlan
    from runner.recipe.schema import Recipe


def _local(recipe: Recipe, plan: RunPlan, *, source: str, overrides: Sequence[str],
           plain: bool, job: EvalJob | None) -> int:
    from runner.launch.rank import run_rank
    from runner.ranks.context import SINGLE

    return run_rank(recipe, plan, SINGLE, source=source, overrides=overrides, plain=plain,
                    job=job)


def _torchrun(recipe: Recipe, plan: RunPlan, *, source: str, overrides: Sequence[str],
              plain: bool, job: EvalJob | None) -> int:
    from runner.launch.payload import Payload
    from runner.launch.torchrun import launch_torchrun

    payload = Payload.of(recipe, source=source, overrides=overrides, cwd=os.getcwd(), plain=plain,
                         job=job)
    return launch_torchrun(payload, recipe.launch.num_processes, recipe.launch.collective_timeout_s)


def _ray(recipe: Recipe, plan: RunPlan, *, source: str, overrides: Sequence[str],
         plain: bool, job: EvalJob | None) -> int:
    from runner.launch.payload import Payload
    from runner.launch.ray_backend import launch_ray

    payload = Payload.of(recipe, source=source, overrides=overrides, cwd=os.getcwd(), plain=plain,
                         job=job)
    return launch_ray(payload, recipe, plan)


BACKENDS: dict[str, Callable[..., int]] = {"local": _local, "torchrun": _torchrun, "ray": _ray}


def launch(recipe: Recipe, plan: RunPlan, ctx: RankContext | None, *, source: str,
           overrides: Sequence[str], plain: bool, job: EvalJob | None = None) -> int:
    """Run a validated recipe: as rank ``ctx`` of an external launcher (``plan`` is then that
    rank's plan), else through ``launch.backend`` (``plan`` is the driver's). ``job``: what the
    ranks do instead of training (None: train; an ``EvalJob``: evaluate)."""
    if ctx is not None:
        from runner.launch.rank import run_rank

        return run_rank(recipe, plan, ctx, source=source, overrides=overrides, plain=plain,
                        job=job)
    return BACKENDS[recipe.launch.backend](recipe, plan, source=source, overrides=overrides,
                                           plain=plain, job=job)


__all__ = ["BACKENDS", "launch"]
