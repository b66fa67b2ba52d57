"""Training: one short loop per algorithm, chosen from one explicit table."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from runner.recipe.plan import RunPlan
from runner.recipe.schema import Recipe
from runner.ui import make_reporter


def _prompt_algorithm(name: str) -> Callable[..., dict]:
    """A GRPO / PPO / OPD run: assemble the PromptRun, run the algorithm's loop, close."""

    def run(recipe: Recipe, plan: RunPlan, reporter: Any, source: str, overrides: Sequence[str]) -> dict:
        import importlib

        from runner.train.session import open_prompt_run

        loop = getattr(importlib.import_module(f"runner.train.{name}"), f"run_{name}")
        prompt_run = open_prompt_run(recipe, plan, reporter, source, overrides)
        try:
            return loop(prompt_run) | {"metrics": prompt_run.metrics.rows}
        finally:
            prompt_run.metrics.close()
            prompt_run.engine.close()

    return run


def _dpo(recipe: Recipe, plan: RunPlan, reporter: Any, source: str, overrides: Sequence[str]) -> dict:
    from runner.train.dpo import run_dpo

    return run_dpo(recipe, plan, reporter, source, overrides)


LOOPS: dict[str, Callable[..., dict]] = {
    "grpo": _prompt_algorithm("grpo"),
    "dpo": _dpo,
    "ppo": _prompt_algorithm("ppo"),
    "opd": _prompt_algorithm("opd"),
}


def run_recipe(recipe: Recipe, plan: RunPlan, *, source: str, overrides: Sequence[str],
               plain: bool) -> int:
    """Run a validated recipe to the end; returns the exit code (0)."""
    reporter = make_reporter(plain)
    started = time.monotonic()
    result = LOOPS[recipe.algo.kind](recipe, plan, reporter, source, overrides)
    reporter.finish(summary_rows(result, plan, time.monotonic() - started))
    return 0


def summary_rows(result: dict, plan: RunPlan, seconds: float) -> list[tuple[str, str]]:
    evals = [r for r in result.get("metrics", []) if any(k.startswith("eval/") for k in r)]
    rows = [("steps", f"{result['step']}/{plan.max_steps}"), ("wall time", f"{seconds:.1f} s")]
    for key in ("eval/accuracy", "eval/preference_accuracy", "eval/reward", "eval/reverse_kl"):
        having = [r for r in evals if key in r]
        if having:
            rows.append((f"held-out {key.split('/')[1]}",
                         f"{having[0][key]:.3f} (step {having[0]['step']}) -> "
                         f"{having[-1][key]:.3f} (step {having[-1]['step']})"))
    from runner.state.checkpoint import latest_checkpoint

    latest = latest_checkpoint(plan.checkpoint_dir)
    rows.append(("checkpoint", str(latest) if latest else "(none)"))
    rows.append(("metrics", str(plan.metrics_path)))
    return rows
