"""The rank program: one policy rank of a run, the same under every launcher."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from runner.ranks.collective import Collective
from runner.ranks.context import RankContext
from runner.recipe.plan import RunPlan
from runner.recipe.schema import Recipe

if TYPE_CHECKING:
    from runner.eval.job import EvalJob


def die_with_driver() -> None:
    """Linux: this process gets SIGKILL when the driver that started it dies, so a killed job
    leaves no rank running on."""
    driver = os.environ.get("POSTTRAIN_DRIVER_PID")
    if driver is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(driver):  # the driver died before prctl took effect
        os._exit(1)


def leave(code: int) -> None:
    """End a rank process with ``code`` once its run is over, without interpreter finalization.

    Everything the run writes is closed (checkpoints synced, metrics appended file by file)
    before this is called. What finalization would still do is tear torch's C++ objects down
    after the interpreter stopped serving threads: a collective backend's worker thread that
    then drops the last reference to a tensor waits for the GIL and the process aborts
    ("terminate called without an active exception"), turning a clean exit into SIGABRT."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run_rank(recipe: Recipe, plan: RunPlan, ctx: RankContext, *, source: str,
             overrides: Sequence[str], plain: bool, roles: Any = None,
             stop: Callable[[], bool] | None = None, job: EvalJob | None = None) -> int:
    """Join the ranks' process group, run the recipe's algorithm on this rank (or, when the
    driver named a ``job``, the evaluation it describes: ``runner.eval.rank.run_eval``), leave.

    ``plan``: this rank's plan (``runner.launch.entry.rank_plan``; the driver's own where the
    driver is the only rank). ``roles``: the role actors this rank calls
    (``runner.launch.ray_roles.RoleActors``; None: every role in this process). ``stop``: asked
    once per step whether the launcher wants the run to stop (where no signal reaches this
    process: a Ray actor)."""
    from runner.launch.entry import error_prefix
    from runner.launch.exits import exit_guard
    from runner.precision import device_type
    from runner.train import run_recipe

    with exit_guard(error_prefix(ctx)):
        # the rank's device, decided here once: the run reads it as comm.device
        comm = Collective.start(ctx, timeout_s=recipe.launch.collective_timeout_s,
                                device=device_type(recipe))
        try:
            if job is not None:
                from runner.eval.rank import run_eval

                return run_eval(recipe, job, ctx=ctx, comm=comm, plain=plain, actors=roles)
            return run_recipe(recipe, plan, ctx=ctx, comm=comm, source=source,
                              overrides=overrides, plain=plain, actors=roles, stop=stop)
        finally:
            comm.close()
