"""PPO's spec: a learned critic, GAE advantages, the KL to a reference folded into rewards."""

from __future__ import annotations

from runner.errors import Problem
from runner.recipe.algos import sampled
from runner.recipe.algos.spec import AlgoSpec, ModelRef, Shape
from runner.recipe.rules import in_range
from runner.recipe.schema import PPOConfig, Recipe


def shape(a: PPOConfig) -> Shape:
    return Shape(a.prompts_per_step, a.prompts_per_step * a.samples_per_prompt, a.ppo_epochs,
                 a.minibatches)


def roles(r: Recipe) -> frozenset[str]:
    """A reference only with ``kl_coef > 0`` (the penalty is 0 otherwise)."""
    return frozenset({"rollout", "reward", "critic"}
                     | ({"reference"} if r.algo.kl_coef > 0 else set()))


def models(a: PPOConfig) -> tuple[ModelRef, ...]:
    return (ModelRef("algo.critic_path", a.critic_path, "critic"),) if a.critic_path else ()


# algo.policy_loss -> the keys only it reads (another loss's key set is a recipe error)
LOSS_KEYS = {"ppo_clip": ("clip_eps", "clip_ratio_c"), "cispo": ("cispo_clip_high",)}


def checks(r: Recipe) -> list[Problem]:
    a = r.algo
    p = sampled.per_prompt_ranges(r)
    p += in_range("algo.minibatches", a.minibatches, a.minibatches >= 1, ">= 1")
    p += in_range("algo.clip_eps", a.clip_eps, 0 < a.clip_eps < 1, "in (0, 1)")
    p += in_range("algo.value_clip_eps", a.value_clip_eps, a.value_clip_eps > 0, "> 0")
    p += in_range("algo.gamma", a.gamma, 0 <= a.gamma <= 1, "in [0, 1]")
    p += in_range("algo.lam", a.lam, 0 <= a.lam <= 1, "in [0, 1]")
    p += in_range("algo.kl_coef", a.kl_coef, a.kl_coef >= 0, ">= 0")
    p += in_range("algo.critic_lr", a.critic_lr, a.critic_lr >= 0, ">= 0")
    p += sampled.policy_loss_ranges(r, LOSS_KEYS) + sampled.overlong_ranges(r)
    p += sampled.minibatches_divide(r, "samples_per_prompt")
    p += sampled.needs_rewards(r, "PPO")
    return p + sampled.engine_is_ranges(r) + sampled.off_policy_ranges(r)


SPEC = AlgoSpec(
    title="PPO", config=PPOConfig, stream="prompts", batch_key="algo.prompts_per_step",
    shape=shape, roles=roles, checks=checks, loop="runner.train.loops.ppo", ahead=sampled.ahead,
    owned_keys=(*sampled.MEDIA_KEYS, "data.id_column", "data.metadata_columns"),
    trains_on_rewards=True, needs_fingerprint=True, models=models,
    scoring_passes=True, balances_ranks=True,
)
