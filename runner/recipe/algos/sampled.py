"""Rules shared by the algorithms that train on their own samples (GRPO, PPO, OPD)."""

from __future__ import annotations

from typing import Any

from runner.errors import Problem
from runner.recipe.rules import env_enabled, in_range
from runner.recipe.schema import Recipe, default_of

MEDIA_KEYS = ("data.image_column", "data.video_column")
MAX_OFF_POLICY_STEPS = 32  # algo.max_off_policy_steps: batches sampled ahead (and checkpointed)


def ahead(algo: Any) -> int:
    """``algo.max_off_policy_steps``: the batches a producer samples ahead of training."""
    return algo.max_off_policy_steps


def off_policy_ranges(r: Recipe) -> list[Problem]:
    """algo.max_off_policy_steps: >= 0 (each rank samples ahead on a producer thread of its own,
    with its own engine or its Ray rollout actor)."""
    k = r.algo.max_off_policy_steps
    p = in_range("algo.max_off_policy_steps", k, k >= 0, ">= 0 (0: synchronous)")
    if k > MAX_OFF_POLICY_STEPS:
        p.append(Problem("algo.max_off_policy_steps", f"must be at most {MAX_OFF_POLICY_STEPS}",
                         got=k))
    p += in_range("rollout.producer_threads", r.rollout.producer_threads,
                  r.rollout.producer_threads >= 0, ">= 0 (0: torch's default)")
    return p


def engine_is_ranges(r: Recipe) -> list[Problem]:
    a = r.algo
    return in_range("algo.engine_is_cap", a.engine_is_cap, a.engine_is_cap >= 1, ">= 1")


def per_prompt_ranges(r: Recipe) -> list[Problem]:
    """PPO's and OPD's step sizes: prompts, samples per prompt and passes, each at least 1."""
    a = r.algo
    p = in_range("algo.prompts_per_step", a.prompts_per_step, a.prompts_per_step >= 1, ">= 1")
    p += in_range("algo.samples_per_prompt", a.samples_per_prompt, a.samples_per_prompt >= 1,
                  ">= 1")
    p += in_range("algo.ppo_epochs", a.ppo_epochs, a.ppo_epochs >= 1, ">= 1")
    return p


def needs_rewards(r: Recipe, title: str) -> list[Problem]:
    """An algorithm whose loss uses rewards needs a reward function or a rewarded [env]."""
    if r.reward.functions or env_enabled(r):
        return []
    return [Problem("reward.functions", f"{title} needs at least one reward function (or an "
                    "[env] whose episodes are rewarded)", got=[])]


def minibatches_divide(r: Recipe, per_prompt_key: str) -> list[Problem]:
    """``algo.minibatches`` splits a step's sequences evenly."""
    a = r.algo
    rollouts = a.prompts_per_step * getattr(a, per_prompt_key)
    if a.minibatches >= 1 and rollouts % a.minibatches:
        return [Problem("algo.minibatches", f"must divide prompts_per_step x {per_prompt_key} "
                        f"({rollouts})", got=a.minibatches)]
    return []


def policy_loss_ranges(r: Recipe, keys_of: dict[str, tuple[str, ...]]) -> list[Problem]:
    """algo.clip_ratio_c (the dual clip: 0, or > 1) and algo.cispo_clip_high, shared by GRPO
    and PPO; and no key of another policy loss than algo.policy_loss set (``keys_of``: each
    loss's own keys)."""
    a = r.algo
    c = a.clip_ratio_c
    p: list[Problem] = []
    if not (c == 0 or c > 1):
        p.append(Problem("algo.clip_ratio_c", "must be 0 (off) or > 1", got=c,
                         hint="the dual clip bounds a negative advantage's loss by -c A, which "
                         "for c <= 1 would cut the loss of an unchanged policy; 3 is common"))
    p += in_range("algo.cispo_clip_high", a.cispo_clip_high, a.cispo_clip_high >= 0, ">= 0")
    for loss, keys in keys_of.items():
        for k in keys:
            value = getattr(a, k)
            if loss != a.policy_loss and value != default_of(type(a), k):
                p.append(Problem(f"algo.{k}", f"is a key of policy_loss = '{loss}', but "
                                 f"policy_loss is '{a.policy_loss}'", got=value,
                                 hint=f"remove it, or set algo.policy_loss = '{loss}'"))
    return p


def overlong_ranges(r: Recipe) -> list[Problem]:
    """reward.overlong_buffer_len / overlong_penalty: a buffer within rollout.max_new_tokens, a
    penalty >= 0, and single replies (an [env] episode's length is not one reply's)."""
    w, n = r.reward, r.rollout.max_new_tokens
    p = in_range("reward.overlong_buffer_len", w.overlong_buffer_len,
                 0 <= w.overlong_buffer_len <= n, f"in [0, rollout.max_new_tokens ({n})]")
    p += in_range("reward.overlong_penalty", w.overlong_penalty, w.overlong_penalty >= 0, ">= 0")
    if w.overlong_buffer_len and env_enabled(r):
        p.append(Problem("reward.overlong_buffer_len", "measures one reply against "
                         "rollout.max_new_tokens; [env] episodes have several",
                         got=w.overlong_buffer_len, hint="set it to 0, or remove the [env] table"))
    return p
