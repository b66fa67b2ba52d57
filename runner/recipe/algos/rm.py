"""The reward model's spec: a scalar score head trained on given preference pairs
(Bradley-Terry); no reference, no engine, no reward functions."""

from __future__ import annotations

from runner.errors import Problem
from runner.recipe.algos.dpo import PAIR_KEYS
from runner.recipe.algos.spec import AlgoSpec, Shape
from runner.recipe.rules import in_range
from runner.recipe.schema import DataConfig, Recipe, RMConfig

# The [data] keys a reward model reads: DPO's pair stream and each pair's margin
RM_KEYS = (*PAIR_KEYS, "data.margin_column")


def shape(a: RMConfig) -> Shape:
    return Shape(a.pairs_per_step, 2 * a.pairs_per_step)


def roles(r: Recipe) -> frozenset[str]:
    """None besides the policy (the scored model): held-out pairs are scored, not generated."""
    return frozenset()


def sharded(a: RMConfig) -> tuple[str, ...]:
    return ()


def margin_problem(data: DataConfig) -> Problem | None:
    """Why ``data.margin_column`` cannot be read: the pairs are the built-in arithmetic ones
    (``data.synthetic_pairs``, or no source at all), which carry no margins; None when it can."""
    if not data.margin_column or data.factory or data.jsonl_path or data.tar_path:
        return None
    return Problem("data.margin_column", "the built-in arithmetic pairs (data.synthetic_pairs) "
                   "carry no margins", got=data.margin_column,
                   hint="give the pairs with their margins as data.jsonl_path, data.tar_path or "
                   "data.factory, or remove data.margin_column")


def checks(r: Recipe) -> list[Problem]:
    a = r.algo
    p = in_range("algo.pairs_per_step", a.pairs_per_step, a.pairs_per_step >= 1, ">= 1")
    p += in_range("algo.center_coef", a.center_coef, a.center_coef >= 0, ">= 0 (0: off)")
    p += in_range("algo.head_lr", a.head_lr, a.head_lr >= 0, ">= 0 (0: train.lr)")
    margin = margin_problem(r.data)
    if margin is not None:
        p.append(margin)
    if r.model.lora.rank > 0:
        p.append(Problem("model.lora.rank", "a reward model trains all its weights and its new "
                         "score head; LoRA adapters are not supported for it",
                         got=r.model.lora.rank, hint="set model.lora.rank = 0"))
    if r.train.sharding == "fsdp":
        p.append(Problem("train.sharding", "a reward model is not sharded in this version",
                         got="fsdp", hint="set train.sharding = 'none' (each rank a full copy)"))
    return p


SPEC = AlgoSpec(
    title="RM", config=RMConfig, stream="pairs", batch_key="algo.pairs_per_step",
    shape=shape, roles=roles, checks=checks, loop="runner.train.loops.rm",
    owned_keys=RM_KEYS, samples_online=False, sharded=sharded, head="score", balances_ranks=True,
)
