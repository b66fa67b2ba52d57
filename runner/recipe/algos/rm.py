"""The reward model's spec: a scalar score head trained on given preference pairs
(Bradley-Terry); no reference, no engine, no reward functions."""

from __future__ import annotations

from runner.errors import Problem
from runner.recipe.algos.dpo import PAIR_KEYS
from runner.recipe.algos.spec import AlgoSpec, Shape
from runner.recipe.rules import in_range
from runner.recipe.schema import Recipe, RMConfig


def shape(a: RMConfig) -> Shape:
    return Shape(a.pairs_per_step, 2 * a.pairs_per_step)


def roles(r: Recipe) -> frozenset[str]:
    """None besides the policy (the scored model): held-out pairs are scored, not generated."""
    return frozenset()


def sharded(a: RMConfig) -> tuple[str, ...]:
    return ()


def checks(r: Recipe) -> list[Problem]:
    a = r.algo
    p = in_range("algo.pairs_per_step", a.pairs_per_step, a.pairs_per_step >= 1, ">= 1")
    p += in_range("algo.center_coef", a.center_coef, a.center_coef >= 0, ">= 0 (0: off)")
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
    owned_keys=PAIR_KEYS, samples_online=False, sharded=sharded, head="score",
)
