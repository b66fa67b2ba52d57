"""RunPlan: values derived from a Recipe (layout, batch sizes, the roles a run builds, paths).
Frozen, like the recipe; the assembly builds exactly the roles it lists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from runner.errors import Problem, RecipeError
from runner.recipe.checks import batch_key
from runner.recipe.held_out import held_out_reason
from runner.recipe.schema import DPOConfig, GRPOConfig, OPDConfig, PPOConfig, Recipe

# Every role a run can build, in the order the assembly builds them.
ROLE_ORDER = ("driver", "policy", "rollout", "reference", "critic", "teacher", "reward")


def planned_roles(recipe: Recipe) -> tuple[str, ...]:
    """The roles a run of ``recipe`` builds (``driver`` being the process that runs the loop).

    GRPO: a reference only with ``kl_beta > 0``; PPO: only with ``kl_coef > 0`` (the penalty
    is 0 otherwise); DPO: a rollout engine and the reward functions only with held-out pairs
    (evaluated by greedy generation too); OPD scores its samples with the recipe's rewards for
    the log.
    """
    a = recipe.algo
    wanted = {"driver", "policy"}
    if isinstance(a, GRPOConfig):
        wanted |= {"rollout", "reward"} | ({"reference"} if a.kl_beta > 0 else set())
    elif isinstance(a, PPOConfig):
        wanted |= {"rollout", "reward", "critic"} | ({"reference"} if a.kl_coef > 0 else set())
    elif isinstance(a, OPDConfig):
        wanted |= {"rollout", "reward", "teacher"}
    elif isinstance(a, DPOConfig):
        wanted.add("reference")
        if not held_out_reason(recipe.data, "dpo"):
            wanted |= {"rollout", "reward"}
    return tuple(r for r in ROLE_ORDER if r in wanted)


def _listed(names: list[str]) -> str:
    """Names as a sentence lists them.

    >>> _listed(["policy"]), _listed(["policy", "critic", "reference"])
    ('policy', 'policy, critic and reference')
    """
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


def sharded_roles(algo: Any) -> tuple[str, ...]:
    """The roles ``train.sharding = "fsdp"`` shards (of those a run of ``algo``, an ``[algo]``
    config, has): the trained ones (the policy, PPO's critic) and the frozen ones (the
    reference; OPD's teacher when it shares the student's tokenizer). Each forward of a sharded
    model is a collective, so ranks holding unequal shares (of a held-out set) run filler
    forwards until every rank has run as many (runner.train.batches.lockstep_fillers). A
    cross-tokenizer teacher scores each item through its own packer and stays whole on every
    rank."""
    same = getattr(algo, "mode", "same_tokenizer") == "same_tokenizer"
    return ("policy", "critic", "reference") + (("teacher",) if same else ())


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
    sharding: str = "none"  # train.sharding
    sharded: tuple[str, ...] = ()  # the roles sharded over the ranks (sharded_roles)

    def rows(self) -> list[tuple[str, str]]:
        """Rows for the dry-run table."""
        return [
            ("algorithm", self.algo),
            ("launch", f"{self.backend}, {self.world_size} process(es)" + (
                f", {_listed([r for r in self.sharded if r in self.roles])} "
                "sharded (FSDP2)" if self.sharding == "fsdp" else "")),
            ("roles", ", ".join(self.roles)),
            ("rollout engine", self._engine_row()),
            ("steps", str(self.max_steps)),
            ("items per step", str(self.items_per_step)),
            ("sequences per step", f"{self.samples_per_step} ({self.samples_per_rank} per rank)"),
            ("optimizer steps per step", f"{self.optimizer_steps_per_step} "
                                         f"(minibatch {self.minibatch_size} per rank)"),
            ("output", str(self.output_dir)),
        ]

    def _engine_row(self) -> str:
        if "rollout" not in self.roles:
            return "(none: offline pairs)"
        return self.engine + (" (held-out generation only)" if self.algo == "dpo" else "")


def make_plan(recipe: Recipe, world_size: int | None = None) -> RunPlan:
    """The plan of ``recipe`` on ``world_size`` ranks (default: the recipe's launch layout; an
    external launcher decides it from its environment)."""
    a = recipe.algo
    world = world_size or (recipe.launch.num_processes if recipe.launch.backend != "local" else 1)
    if isinstance(a, GRPOConfig):
        items, samples, passes, splits = (a.prompts_per_step, a.prompts_per_step * a.group_size,
                                          a.ppo_epochs, a.minibatches)
    elif isinstance(a, PPOConfig):
        items, samples, passes, splits = (a.prompts_per_step,
                                          a.prompts_per_step * a.samples_per_prompt,
                                          a.ppo_epochs, a.minibatches)
    elif isinstance(a, OPDConfig):
        items, samples, passes, splits = (a.prompts_per_step,
                                          a.prompts_per_step * a.samples_per_prompt,
                                          a.ppo_epochs, 1)
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
        roles=planned_roles(recipe),
        engine=recipe.rollout.engine,
        output_dir=out,
        checkpoint_dir=out / "checkpoints",
        metrics_path=out / "metrics.jsonl",
        resolved_path=out / "recipe.resolved.toml",
        sharding=recipe.train.sharding,
        sharded=sharded_roles(a) if recipe.train.sharding == "fsdp" else (),
    )
