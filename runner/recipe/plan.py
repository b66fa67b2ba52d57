"""RunPlan: values derived from a Recipe (layout, batch sizes, the roles a run builds, paths).
Frozen, like the recipe; the assembly builds exactly the roles it lists."""

from __future__ import annotations

from pathlib import Path

import attrs

from runner.errors import Problem, RecipeError
from runner.recipe.algos import spec_of
from runner.recipe.checks import batch_key
from runner.recipe.schema import Recipe, TrainConfig
from runner.state.run_folder import RunFolder

# Every role a run can build, in the order the assembly builds them.
ROLE_ORDER = ("driver", "policy", "rollout", "reference", "critic", "teacher", "reward")


def planned_roles(recipe: Recipe) -> tuple[str, ...]:
    """The roles a run of ``recipe`` builds (``driver`` being the process that runs the loop):
    the driver and the policy, and those its algorithm asks for (``AlgoSpec.roles``)."""
    wanted = {"driver", "policy"} | spec_of(recipe).roles(recipe)
    return tuple(r for r in ROLE_ORDER if r in wanted)


def _listed(names: list[str]) -> str:
    """Names as a sentence lists them.

    >>> _listed(["policy"]), _listed(["policy", "critic", "reference"])
    ('policy', 'policy, critic and reference')
    """
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


def sharded_roles(recipe: Recipe) -> tuple[str, ...]:
    """The roles ``train.sharding = "fsdp"`` shards (of those a run of the recipe's algorithm
    may have, ``AlgoSpec.sharded``): the trained ones (the policy, PPO's critic) and the frozen
    ones that score the policy's own tokens. Each forward of a sharded model is a collective, so
    ranks holding unequal shares (of a held-out set) run filler forwards until every rank has
    run as many (runner.train.loops.batches.lockstep)."""
    return spec_of(recipe).sharded(recipe.algo)


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
    samples_online: bool = True  # AlgoSpec.samples_online: the engine samples training batches
    ahead: int = 0  # steps whose batches a producer samples ahead (AlgoSpec.ahead; 0: synchronous)
    most_items: int = 0  # the most items a step may draw (AlgoSpec.batches); 0: items_per_step
    max_tokens_per_microbatch: int = 0  # train.max_tokens_per_microbatch (0: off)
    logprob_max_tokens_per_microbatch: int = 0  # train.logprob_max_tokens_per_microbatch
    max_row_tokens: int = 0  # the longest a sampled row may be (rollout.max_model_len; 0: none)
    balanced: bool = False  # the update's rows split between the ranks by tokens (balances)

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
            ("items per step", str(self.items_per_step) + (
                f" (up to {self.most_items}: groups with all-equal rewards are dropped and "
                "more drawn)" if self.most_items > self.items_per_step else "")),
            ("sequences per step", f"{self.samples_per_step} ({self.samples_per_rank} per rank)"),
            ("optimizer steps per step", f"{self.optimizer_steps_per_step} "
                                         f"(minibatch {self.minibatch_size} per rank)"),
            *self._micro_batch_rows(),
            ("output", str(self.output_dir)),
        ]

    def _micro_batch_rows(self) -> list[tuple[str, str]]:
        out = []
        if self.max_tokens_per_microbatch:
            most = most_micro_batches(self.minibatch_size, self.max_row_tokens,
                                      self.max_tokens_per_microbatch)
            if self.balanced:
                most = most_balanced(self.minibatch_size, self.samples_per_step
                                     // max(1, self.items_per_step), self.max_row_tokens,
                                     self.max_tokens_per_microbatch)
            out.append(("micro-batches", f"up to {self.max_tokens_per_microbatch} tokens each, "
                        "packed best-fit (a longer row alone); as many on every rank as on the "
                        "busiest" + (f"; at most {most} per optimizer step" if most else "")))
            if self.balanced:
                rows = self.minibatch_size * self.world_size
                out.append(("rank balance", f"each optimizer step's {rows} sequences split "
                            f"between the {self.world_size} ranks by tokens before packing "
                            "(about equal tokens and micro-batches on every rank)"))
        if self.logprob_max_tokens_per_microbatch:
            out.append(("scoring passes", f"up to {self.logprob_max_tokens_per_microbatch} "
                        "tokens each, packed best-fit; as many on every rank as on the busiest"))
        return out

    def _engine_row(self) -> str:
        if "rollout" not in self.roles:
            return "(none: offline pairs)"
        return self.engine + ("" if self.samples_online else " (held-out generation only)")


def make_plan(recipe: Recipe, world_size: int | None = None) -> RunPlan:
    """The plan of ``recipe`` on ``world_size`` ranks (default: the recipe's launch layout; an
    external launcher decides it from its environment)."""
    spec = spec_of(recipe)
    world = world_size or (recipe.launch.num_processes if recipe.launch.backend != "local" else 1)
    shape = spec.shape(recipe.algo)
    items, samples, passes, splits = shape.items, shape.samples, shape.passes, shape.splits
    if items % world:  # the recipe checks cover launch.num_processes; this is an external launcher
        key, _ = batch_key(recipe)
        raise RecipeError([Problem(key, f"{items} items per step do not split evenly over the "
                                   f"launcher's {world} ranks", got=items,
                                   hint=f"use a multiple of {world}, or start another number of "
                                   "processes")])
    per_rank = samples // world
    out = Path(recipe.run.output_dir)
    return RunPlan(
        algo=recipe.algo.kind,
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
        checkpoint_dir=RunFolder(out).checkpoints,
        metrics_path=RunFolder(out).metrics,
        resolved_path=RunFolder(out).resolved,
        sharding=recipe.train.sharding,
        sharded=sharded_roles(recipe) if recipe.train.sharding == "fsdp" else (),
        samples_online=spec.samples_online,
        ahead=spec.ahead(recipe.algo),
        most_items=items * spec.batches(recipe.algo),
        max_tokens_per_microbatch=recipe.train.max_tokens_per_microbatch,
        logprob_max_tokens_per_microbatch=recipe.train.logprob_max_tokens_per_microbatch,
        max_row_tokens=recipe.rollout.max_model_len if spec.samples_online else 0,
        balanced=spec.balances_ranks and ranks_balanced(recipe.train, world),
    )


def ranks_balanced(train: TrainConfig, world: int) -> bool:
    """Whether an algorithm that can (``AlgoSpec.balances_ranks``) splits each optimizer
    step's rows between ``world`` ranks by tokens: with a token budget,
    ``train.balance_ranks`` and several ranks."""
    return world > 1 and train.max_tokens_per_microbatch > 0 and train.balance_ranks


def most_balanced(rows: int, unit: int, longest: int, budget: int) -> int:
    """``most_micro_batches`` of a rank whose rows are balanced by tokens in units of ``unit``
    rows (a prompt's): it holds at most the mean, ``rows`` rows of at most ``longest`` tokens,
    plus the last unit it took, and every micro-batch but the last more than ``budget -
    longest`` tokens (0: unknown, no ``longest``, or a row may be over the budget: then the
    count of short rows a rank takes is not bounded by ``rows``).

    >>> most_balanced(32, 8, 64, 256), most_balanced(32, 8, 0, 256), most_balanced(4, 2, 9, 8)
    (14, 0, 0)
    """
    if not longest or longest > budget:
        return 0
    return (rows + unit) * longest // (budget - longest + 1) + 1


def most_micro_batches(rows: int, longest: int, budget: int) -> int:
    """The most micro-batches best-fit decreasing packs ``rows`` rows of at most ``longest``
    tokens into within ``budget`` (0: unknown, no ``longest``). A micro-batch is opened only
    when the row does not fit any open one, so every micro-batch but the last holds more than
    ``budget - longest`` tokens.

    >>> most_micro_batches(16, 40, 100), most_micro_batches(16, 40, 30), most_micro_batches(4, 0, 9)
    (11, 16, 0)
    """
    if not longest:
        return 0
    if longest > budget:
        return rows
    return min(rows, rows * longest // (budget - longest + 1) + 1)
