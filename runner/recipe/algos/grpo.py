"""GRPO's spec: groups of completions per prompt, rewards compared within a group."""

from __future__ import annotations

from runner.errors import Problem
from runner.recipe.algos import sampled
from runner.recipe.algos.spec import AlgoSpec, Shape
from runner.recipe.rules import in_range
from runner.recipe.schema import GRPOConfig, Recipe


def shape(a: GRPOConfig) -> Shape:
    return Shape(a.prompts_per_step, a.prompts_per_step * a.group_size, a.ppo_epochs,
                 a.minibatches)


def roles(r: Recipe) -> frozenset[str]:
    """A reference only with ``kl_beta > 0``."""
    return frozenset({"rollout", "reward"} | ({"reference"} if r.algo.kl_beta > 0 else set()))


def checks(r: Recipe) -> list[Problem]:
    a = r.algo
    p = in_range("algo.group_size", a.group_size, a.group_size >= 2, ">= 2 (advantages compare "
                 "completions within a group)")
    p += in_range("algo.prompts_per_step", a.prompts_per_step, a.prompts_per_step >= 1, ">= 1")
    p += in_range("algo.ppo_epochs", a.ppo_epochs, a.ppo_epochs >= 1, ">= 1")
    p += in_range("algo.minibatches", a.minibatches, a.minibatches >= 1, ">= 1")
    p += in_range("algo.clip_eps_low", a.clip_eps_low, 0 <= a.clip_eps_low < 1, "in [0, 1)")
    p += in_range("algo.clip_eps_high", a.clip_eps_high, a.clip_eps_high >= 0, ">= 0")
    p += in_range("algo.kl_beta", a.kl_beta, a.kl_beta >= 0, ">= 0")
    p += sampled.minibatches_divide(r, "group_size")
    p += sampled.needs_rewards(r, "GRPO")
    p += sampled.engine_is_ranges(r)
    p += sampled.off_policy_ranges(r)
    if a.engine_is_correction and a.old_logprobs == "engine":
        p.append(Problem("algo.engine_is_correction", "compares the policy's behaviour logprobs "
                         "with the engine's, but algo.old_logprobs = 'engine' makes them the same",
                         got=True,
                         hint="set algo.old_logprobs = 'policy', or turn the correction off"))
    return p


SPEC = AlgoSpec(
    title="GRPO", config=GRPOConfig, stream="prompts", batch_key="algo.prompts_per_step",
    shape=shape, roles=roles, checks=checks, loop="runner.train.loops.grpo", ahead=sampled.ahead,
    owned_keys=sampled.MEDIA_KEYS, trains_on_rewards=True,
)
