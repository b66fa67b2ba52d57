"""GRPO's spec: groups of completions per prompt, rewards compared within a group."""

from __future__ import annotations

from runner.errors import Problem
from runner.recipe.algos import sampled
from runner.recipe.algos.spec import AlgoSpec, Shape
from runner.recipe.rules import in_range
from runner.recipe.schema import GRPOConfig, Recipe, default_of


def shape(a: GRPOConfig) -> Shape:
    return Shape(a.prompts_per_step, a.prompts_per_step * a.group_size, a.ppo_epochs,
                 a.minibatches)


def roles(r: Recipe) -> frozenset[str]:
    """A reference only with ``kl_beta > 0``."""
    return frozenset({"rollout", "reward"} | ({"reference"} if r.algo.kl_beta > 0 else set()))


# algo.advantage -> the fewest completions per prompt it compares (REINFORCE++ normalises over
# the batch, so a prompt may have one).
MIN_GROUP = {"grpo": 2, "rloo": 2, "reinforce_pp": 1, "reinforce_pp_baseline": 2}
WHY_GROUP = {"rloo": "the leave-one-out baseline is the mean of the group's other members",
             "reinforce_pp_baseline": "the baseline is the group's mean"}


# algo.policy_loss -> the keys only it reads (another loss's key set is a recipe error)
LOSS_KEYS = {"ppo_clip": ("clip_eps_low", "clip_eps_high", "clip_ratio_c"),
             "gspo": ("gspo_clip_low", "gspo_clip_high"), "cispo": ("cispo_clip_high",)}


def checks(r: Recipe) -> list[Problem]:
    a = r.algo
    least = MIN_GROUP[a.advantage]
    why = WHY_GROUP.get(a.advantage, "advantages compare completions within a group")
    p = in_range("algo.group_size", a.group_size, a.group_size >= least,
                 f">= {least} with advantage = '{a.advantage}' ({why})")
    p += in_range("algo.prompts_per_step", a.prompts_per_step, a.prompts_per_step >= 1, ">= 1")
    p += in_range("algo.ppo_epochs", a.ppo_epochs, a.ppo_epochs >= 1, ">= 1")
    p += in_range("algo.minibatches", a.minibatches, a.minibatches >= 1, ">= 1")
    p += in_range("algo.clip_eps_low", a.clip_eps_low, 0 <= a.clip_eps_low < 1, "in [0, 1)")
    p += in_range("algo.clip_eps_high", a.clip_eps_high, a.clip_eps_high >= 0, ">= 0")
    p += in_range("algo.kl_beta", a.kl_beta, a.kl_beta >= 0, ">= 0")
    p += family_checks(a)
    p += dynamic_sampling_checks(a)
    p += sampled.policy_loss_ranges(r, LOSS_KEYS)
    p += sampled.minibatches_divide(r, "group_size")
    p += sampled.needs_rewards(r, "GRPO")
    p += sampled.engine_is_ranges(r)
    p += sampled.off_policy_ranges(r)
    p += sampled.overlong_ranges(r)
    if a.engine_is_correction and a.old_logprobs == "engine":
        p.append(Problem("algo.engine_is_correction", "compares the policy's behaviour logprobs "
                         "with the engine's, but algo.old_logprobs = 'engine' makes them the same",
                         got=True,
                         hint="set algo.old_logprobs = 'policy', or turn the correction off"))
    return p


def family_checks(a: GRPOConfig) -> list[Problem]:
    """The GRPO family's keys that only make sense together: scale_rewards with the grpo
    estimator, GSPO with its sequence mean, the shared-prefix filter with a group."""
    p = in_range("algo.gspo_clip_low", a.gspo_clip_low, 0 <= a.gspo_clip_low < 1, "in [0, 1)")
    p += in_range("algo.gspo_clip_high", a.gspo_clip_high, a.gspo_clip_high >= 0, ">= 0")
    if a.scale_rewards != "group" and a.advantage != "grpo":
        p.append(Problem("algo.scale_rewards", f"only applies to advantage = 'grpo' (the "
                         f"'{a.advantage}' estimator has its own scale)", got=a.scale_rewards,
                         hint="remove algo.scale_rewards, or set algo.advantage = 'grpo'"))
    if a.policy_loss == "gspo" and a.loss_agg != "seq_mean":
        p.append(Problem("algo.loss_agg", "policy_loss = 'gspo' averages each sequence's tokens, "
                         "then the sequences (the GSPO objective); it needs loss_agg = "
                         "'seq_mean'", got=a.loss_agg, hint="set algo.loss_agg = 'seq_mean'"))
    if a.shared_prefix_filter and a.group_size < 2:
        p.append(Problem("algo.shared_prefix_filter", "needs a group of at least 2 completions "
                         "to share a prefix", got=True,
                         hint="raise algo.group_size, or turn the filter off"))
    return p


def dynamic_sampling_checks(a: GRPOConfig) -> list[Problem]:
    """DAPO's dynamic sampling: a cap of at least one batch, read only when it is on; a group
    to compare (its rewards all equal is what it drops); a group estimator."""
    p = in_range("algo.max_sample_batches", a.max_sample_batches, a.max_sample_batches >= 1,
                 ">= 1 (the first batch of the step counts)")
    if a.dynamic_sampling == "off":
        if a.max_sample_batches != default_of(GRPOConfig, "max_sample_batches"):
            p.append(Problem("algo.max_sample_batches", "is read only with dynamic_sampling = "
                             "'filter', but dynamic_sampling is 'off'", got=a.max_sample_batches,
                             hint="remove it, or set algo.dynamic_sampling = 'filter'"))
        return p
    if a.group_size < 2:
        p.append(Problem("algo.dynamic_sampling", "drops the groups whose rewards are all equal, "
                         f"and a group of {a.group_size} completion always is", got="filter",
                         hint="raise algo.group_size to at least 2, or set "
                         "algo.dynamic_sampling = 'off'"))
    if a.advantage == "reinforce_pp":
        p.append(Problem("algo.dynamic_sampling", "drops groups with no advantage signal within "
                         "the group, but advantage = 'reinforce_pp' normalises over the batch, "
                         "not the group", got="filter",
                         hint="use a group estimator (algo.advantage = 'grpo', 'rloo' or "
                         "'reinforce_pp_baseline'), or set algo.dynamic_sampling = 'off'"))
    return p


# algo.dynamic_sampling -> the most batches of prompts_per_step prompts a step draws
BATCHES = {"off": lambda a: 1, "filter": lambda a: a.max_sample_batches}


def batches(a: GRPOConfig) -> int:
    return BATCHES[a.dynamic_sampling](a)


SPEC = AlgoSpec(
    title="GRPO", config=GRPOConfig, stream="prompts", batch_key="algo.prompts_per_step",
    shape=shape, roles=roles, checks=checks, loop="runner.train.loops.grpo", ahead=sampled.ahead,
    owned_keys=sampled.MEDIA_KEYS, trains_on_rewards=True, batches=batches, scoring_passes=True,
    balances_ranks=True,
)
