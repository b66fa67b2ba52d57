"""DPO's spec: given preference pairs against a frozen reference; no sampling while it trains."""

from __future__ import annotations

from runner.errors import Problem
from runner.recipe.algos.spec import AlgoSpec, Shape
from runner.recipe.held_out import held_out_reason
from runner.recipe.rules import in_range
from runner.recipe.schema import DPOConfig, Recipe

# The [data] keys of the preference-pair stream (DPO's, and the reward model's)
PAIR_KEYS = ("data.jsonl_path", "data.tar_path", "data.synthetic_pairs", "data.synthetic_rejected",
             "data.chosen_key", "data.rejected_key", "data.validation.jsonl_path")


def shape(a: DPOConfig) -> Shape:
    return Shape(a.pairs_per_step, 2 * a.pairs_per_step)


def roles(r: Recipe) -> frozenset[str]:
    """A rollout engine and the reward functions only with held-out pairs (evaluated by greedy
    generation too)."""
    held_out = {"rollout", "reward"} if not held_out_reason(r.data, "pairs") else set()
    return frozenset({"reference"} | held_out)


def checks(r: Recipe) -> list[Problem]:
    a = r.algo
    p = in_range("algo.beta", a.beta, a.beta > 0, "> 0")
    p += in_range("algo.pairs_per_step", a.pairs_per_step, a.pairs_per_step >= 1, ">= 1")
    # 0.5 would make the loss symmetric in chosen and rejected: nothing left to learn.
    p += in_range("algo.label_smoothing", a.label_smoothing, 0 <= a.label_smoothing < 0.5,
                  "in [0, 0.5)")
    if a.loss == "ipo" and a.label_smoothing:
        p.append(Problem("algo.label_smoothing", "applies to the sigmoid loss only, but algo.loss "
                         "is 'ipo'", got=a.label_smoothing,
                         hint="set algo.label_smoothing = 0, or algo.loss = 'sigmoid'"))
    p += in_range("algo.sft_weight", a.sft_weight, a.sft_weight >= 0, ">= 0")
    return p


SPEC = AlgoSpec(
    title="DPO", config=DPOConfig, stream="pairs", batch_key="algo.pairs_per_step",
    shape=shape, roles=roles, checks=checks, loop="runner.train.loops.dpo",
    owned_keys=PAIR_KEYS,
    samples_online=False, scoring_passes=True, balances_ranks=True,
)
