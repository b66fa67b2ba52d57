"""RunPlan: values derived from a Recipe (layout, batch sizes, paths). Frozen, like the recipe."""

from __future__ import annotations

from pathlib import Path

import attrs

from runner.errors import Problem, RecipeError
from runner.recipe.checks import batch_key
from runner.recipe.schema import DPOConfig, GRPOConfig, OPDConfig, PPOConfig, Recipe

_ROLES = {
    "grpo": ("driver", "rollout", "policy", "reward"),
    "dpo": ("driver", "policy", "reference"),
    "ppo": ("driver", "rollout", "policy", "reference", "critic", "reward"),
    "opd": ("driver", "rollout", "policy", "teacher"),
}


@attrs.frozen
class RunPlan:
    algo: str
    world_size: int
    backend: str
    items_per_step: int  # prompts (GRPO/PPO/OPD) or pairs (DPO) drawn per step, all ranks
    samples_per_step: int  # sequences trained on per step, all ranks
    samples_per_rank: int
    minibatch_size: int  # sequences per optimizer step, per rank
    optimizer_steps_per_step: int
    max_steps: int
    roles: tuple[str, ...]
    engine: str
    output_dir: Path
    checkpoint_dir: Path
    metrics_path: Path
    resolved_path: Path

    def rows(self) -> list[tuple[str, str]]:
        """Rows for the dry-run table."""
        return [
            ("algorithm", self.algo),
            ("launch", f"{self.backend}, {self.world_size} process(es)"),
            ("roles", ", ".join(self.roles)),
            ("rollout engine", self.engine if self.algo != "dpo" else "(none: offline pairs)"),
            ("steps", str(self.max_steps)),
            ("items per step", str(self.items_per_step)),
            ("sequences per step", f"{self.samples_per_step} ({self.samples_per_rank} per rank)"),
            ("optimizer steps per step", f"{self.optimizer_steps_per_step} "
                                         f"(minibatch {self.minibatch_size} per rank)"),
            ("output", str(self.output_dir)),
        ]


def make_plan(recipe: Recipe, world_size: int | None = None) -> RunPlan:
    """The plan of ``recipe`` on ``world_size`` ranks (default: the recipe's launch layout; an
    external launcher decides it from its environment)."""
    a = recipe.algo
    world = world_size or (recipe.launch.num_processes if recipe.launch.backend != "local" else 1)
    if isinstance(a, GRPOConfig):
        items, samples, passes, splits = a.prompts_per_step, a.prompts_per_step * a.group_size, a.ppo_epochs, a.minibatches
    elif isinstance(a, PPOConfig):
        items, samples, passes, splits = a.prompts_per_step, a.prompts_per_step * a.samples_per_prompt, a.ppo_epochs, a.minibatches
    elif isinstance(a, OPDConfig):
        items, samples, passes, splits = a.prompts_per_step, a.prompts_per_step * a.samples_per_prompt, a.ppo_epochs, 1
    elif isinstance(a, DPOConfig):
        items, samples, passes, splits = a.pairs_per_step, 2 * a.pairs_per_step, 1, 1
    else:  # pragma: no cover - the converter admits only the kinds above
        raise TypeError(f"unknown algo config {type(a).__name__}")
    if items % world:  # the recipe checks cover launch.num_processes; this is an external launcher
        key, _ = batch_key(recipe)
        raise RecipeError([Problem(key, f"{items} items per step do not split evenly over the "
                                   f"launcher's {world} ranks", got=items,
                                   hint=f"use a multiple of {world}, or start another number of "
                                   "processes")])
    per_rank = samples // world
    out = Path(recipe.run.output_dir)
    return RunPlan(
        algo=a.kind,
        world_size=world,
        backend=recipe.launch.backend,
        items_per_step=items,
        samples_per_step=samples,
        samples_per_rank=per_rank,
        minibatch_size=max(1, per_rank // splits),
        optimizer_steps_per_step=passes * splits,
        max_steps=recipe.run.max_steps,
        roles=_ROLES[a.kind],
        engine=recipe.rollout.engine,
        output_dir=out,
        checkpoint_dir=out / "checkpoints",
        metrics_path=out / "metrics.jsonl",
        resolved_path=out / "recipe.resolved.toml",
    )
