"""Training: one short loop per algorithm, chosen from one explicit table, on one rank."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from runner.ranks.collective import Collective
from runner.ranks.context import RankContext
from runner.recipe.algos import spec_of
from runner.recipe.plan import RunPlan
from runner.recipe.schema import Recipe
from runner.train.assembly.assemble import assemble
from runner.train.assembly.run import RunContext
from runner.train.loops.loop import AgreedStop
from runner.train.roles import RoleProvider
from runner.ui import SilentReporter, make_reporter


def loop_of(recipe: Recipe) -> Callable[[RunContext], dict[str, Any]]:
    """The recipe's training loop (``AlgoSpec.loop``): runs the assembled run to its last step,
    returns {"step": ...}."""
    return importlib.import_module(spec_of(recipe).loop).run


def run_recipe(recipe: Recipe, plan: RunPlan, *, ctx: RankContext, comm: Collective, source: str,
               overrides: Sequence[str], plain: bool, actors: RoleProvider | None = None,
               stop: Callable[[], bool] | None = None) -> int:
    """Run a validated recipe to the end on this rank; returns the exit code (0)."""
    started = time.monotonic()
    loop = loop_of(recipe)
    # Leaving the block by any path (an error, Ctrl-C) tears the live view down first.
    with make_reporter(plain) if ctx.is_main else SilentReporter() as reporter:
        run = assemble(recipe, plan, ctx=ctx, comm=comm, reporter=reporter, source=source,
                       overrides=overrides, actors=actors, stop=stop)
        outcome = "failed"
        try:
            result = loop(run) | {"metrics": run.svc.metrics.rows}
            comm.barrier()  # leave together: no rank tears its connections down under another
            outcome = "finished"
        except AgreedStop:
            outcome = "stopped"
            comm.barrier()  # a stop after the same step on every rank: leave together too
            raise
        finally:
            run.close(outcome)
        reporter.finish(summary_rows(result, plan, time.monotonic() - started))
    return 0


def summary_rows(result: dict, plan: RunPlan, seconds: float) -> list[tuple[str, str]]:
    evals = [r for r in result.get("metrics", []) if any(k.startswith("eval/") for k in r)]
    rows = [("steps", f"{result['step']}/{plan.max_steps}"), ("wall time", f"{seconds:.1f} s")]
    if plan.world_size > 1:
        rows.append(("ranks", f"{plan.world_size} ({plan.backend})"))
    keys = sorted({k for r in evals for k in r
                   if k.startswith(("eval/reward", "eval/pass@", "eval/maj@"))})
    for key in ("eval/preference_accuracy", *keys, "eval/reverse_kl", "eval/reverse_kl_exact"):
        having = [r for r in evals if key in r]
        if having:
            rows.append((f"held-out {key.split('/', 1)[1]}",
                         f"{having[0][key]:.3f} (step {having[0]['step']}) -> "
                         f"{having[-1][key]:.3f} (step {having[-1]['step']})"))
    from runner.state.load import latest_checkpoint

    latest = latest_checkpoint(plan.checkpoint_dir)
    rows.append(("checkpoint", str(latest) if latest else "(none)"))
    rows.append(("metrics", str(plan.metrics_path)))
    return rows
