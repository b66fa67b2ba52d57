"""Where the rank program runs: one process (``local``), N processes on this machine
(``torchrun``, or an external ``torchrun`` / ``accelerate launch`` detected from the
environment), or N Ray actors (``ray``). An explicit table, no registration by import."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from runner.ranks.context import SINGLE, RankContext
from runner.recipe.schema import Recipe


def _local(recipe: Recipe, *, source: str, overrides: Sequence[str], plain: bool) -> int:
    from runner.launch.rank import run_rank

    return run_rank(recipe, SINGLE, source=source, overrides=overrides, plain=plain)


def _torchrun(recipe: Recipe, *, source: str, overrides: Sequence[str], plain: bool) -> int:
    from runner.launch.payload import Payload
    from runner.launch.torchrun import launch_torchrun

    payload = Payload.of(recipe, source=source, overrides=overrides, cwd=os.getcwd(), plain=plain)
    return launch_torchrun(payload, recipe.launch.num_processes, recipe.launch.collective_timeout_s)


def _ray(recipe: Recipe, *, source: str, overrides: Sequence[str], plain: bool) -> int:
    from runner.launch.payload import Payload
    from runner.launch.ray_backend import launch_ray

    payload = Payload.of(recipe, source=source, overrides=overrides, cwd=os.getcwd(), plain=plain)
    return launch_ray(payload, recipe)


BACKENDS: dict[str, Callable[..., int]] = {"local": _local, "torchrun": _torchrun, "ray": _ray}


def launch(recipe: Recipe, *, source: str, overrides: Sequence[str], plain: bool) -> int:
    """Run a validated recipe: as a rank of an external launcher when the environment says so,
    else through ``launch.backend``."""
    ctx = RankContext.from_env()
    if ctx is not None:
        from runner.launch.rank import run_rank

        return run_rank(recipe, ctx, source=source, overrides=overrides, plain=plain)
    return BACKENDS[recipe.launch.backend](recipe, source=source, overrides=overrides, plain=plain)


__all__ = ["BACKENDS", "launch"]
