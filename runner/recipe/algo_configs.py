"""The ``[algo]`` table: one frozen config class per algorithm, tagged by ``kind``. What else the
package knows of each kind (items per step, roles, data stream, loop) is its spec in
``runner.recipe.algos``; adding a kind adds its class here and its row there."""

from typing import Literal, get_args

import attrs

from runner.recipe.fields import key


@attrs.frozen
class GRPOConfig:
    kind: Literal["grpo"] = key("grpo", "Group Relative Policy Optimization.")
    prompts_per_step: int = key(8, "Prompts drawn from the cursor per step.")
    group_size: int = key(8, "Completions sampled per prompt (at least 2).")
    ppo_epochs: int = key(1, "Passes over each batch of rollouts.")
    minibatches: int = key(1, "Optimizer steps per pass (the batch is split this many ways).")
    clip_eps_low: float = key(
        0.2, "ppo_clip: lower clip of the importance ratio: 1 - eps_low."
    )
    clip_eps_high: float = key(
        0.2, "ppo_clip: upper clip of the importance ratio: 1 + eps_high."
    )
    advantage: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = key(
        "grpo", "grpo: reward minus the group mean, scaled by scale_rewards; rloo: reward minus "
        "the mean of the group's other members; reinforce_pp: REINFORCE++, each token's return "
        "(the reward minus kl_beta x the per-token KL to the reference from it to the end) "
        "normalised over the batch's tokens; reinforce_pp_baseline: reward minus the group "
        "mean, normalised over the batch's tokens."
    )
    scale_rewards: Literal["group", "batch", "none"] = key(
        "group", "advantage = 'grpo' only: divide advantages by the group's std, the batch's "
        "std, or not at all."
    )
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = key(
        "ppo_clip", "ppo_clip: PPO's clipped ratio per token (clip_eps_low/high, clip_ratio_c); "
        "gspo: the sequence's ratio (exp of its mean token log-ratio) clipped per sequence "
        "(gspo_clip_low/high; needs loss_agg = 'seq_mean'); cispo: the clipped, "
        "stop-gradient ratio times the token's logprob, no token dropped (cispo_clip_high)."
    )
    clip_ratio_c: float = key(
        0.0, "Dual clip (policy_loss = 'ppo_clip'): a token with a negative advantage A loses "
        "at most -clip_ratio_c x A however large its ratio. 0: off; otherwise > 1."
    )
    gspo_clip_low: float = key(3e-4, "GSPO: lower clip of the sequence ratio: 1 - low.")
    gspo_clip_high: float = key(4e-4, "GSPO: upper clip of the sequence ratio: 1 + high.")
    cispo_clip_high: float = key(
        4.0, "CISPO: upper bound of the importance weight: 1 + high (no lower bound; the "
        "default 4 bounds it at 5, ScaleRL's value)."
    )
    loss_agg: Literal["token_mean", "seq_mean", "seq_mean_token_sum", "dr_grpo"] = key(
        "token_mean",
        "token_mean: mean over all tokens of the batch; seq_mean: mean per sequence then over "
        "sequences; seq_mean_token_sum: sum per sequence, mean over sequences; dr_grpo: sum "
        "divided by a constant (max_new_tokens x sequences).",
    )
    mask_truncated: bool = key(
        False, "Completions that hit rollout.max_new_tokens without finishing carry no loss "
        "(their rewards still count in their group's advantages)."
    )
    kl_beta: float = key(
        0.0, "Weight of the k3 KL to the frozen reference (0 disables the reference)."
    )
    old_logprobs: Literal["policy", "engine"] = key(
        "policy", "Where the behaviour logprobs come from: recomputed by the policy, or the "
        "engine's."
    )
    shared_prefix_filter: bool = key(
        False, "Leave out of the loss the completion tokens every member of a group shares at its "
        "start (measured on the engine's token ids); they carry no signal within the group."
    )
    engine_is_correction: bool = key(
        False, "Weight each token's loss by the truncated importance ratio min(pi_old / "
        "pi_engine, engine_is_cap) of the policy's and the engine's sampling probabilities, "
        "correcting for an engine that computes with other numerics (e.g. bf16 weights)."
    )
    engine_is_cap: float = key(2.0, "Upper bound (>= 1) of the engine importance weight.")
    dynamic_sampling: Literal["off", "filter"] = key(
        "off", "filter: DAPO's dynamic sampling. Groups whose rewards are all equal (no "
        "advantage signal) are dropped and more prompts are drawn from the cursor, "
        "prompts_per_step at a time, until prompts_per_step groups are kept or "
        "max_sample_batches batches were drawn (then the step trains on the groups it kept)."
    )
    max_sample_batches: int = key(
        3, "dynamic_sampling = 'filter': the most batches of prompts_per_step prompts drawn in "
        "one step (>= 1)."
    )
    max_off_policy_steps: int = key(
        0, "0: sample, then train (synchronous). k >= 1: a producer samples the batches of the "
        "next k steps while the current one trains, so the batch trained at step t was sampled "
        "by the policy of at least step t - k (its behaviour logprobs are the engine's; "
        "engine_is_correction weighs the loss by the truncated ratio against them). At most 32."
    )


@attrs.frozen
class DPOConfig:
    kind: Literal["dpo"] = key("dpo", "Direct Preference Optimization.")
    pairs_per_step: int = key(16, "Preference pairs per optimizer step.")
    beta: float = key(0.1, "Inverse temperature of the implicit reward.")
    loss: Literal["sigmoid", "ipo"] = key("sigmoid", "sigmoid (DPO) or ipo (squared loss).")
    label_smoothing: float = key(
        0.0, "Conservative DPO (sigmoid loss only): assumed rate of flipped labels, in [0, 0.5)."
    )
    sft_weight: float = key(
        0.0, "Weight of the NLL of the chosen answer (per token) added to the preference loss "
        "(RPO's alpha); keeps the chosen answer likely while the pair is pushed apart. 0: off."
    )
    precompute_reference: bool = key(
        False, "Compute the reference logprobs once for the whole dataset and cache them."
    )


@attrs.frozen
class PPOConfig:
    kind: Literal["ppo"] = key("ppo", "Proximal Policy Optimization with a learned critic.")
    prompts_per_step: int = key(16, "Prompts drawn from the cursor per step.")
    samples_per_prompt: int = key(1, "Completions sampled per prompt.")
    ppo_epochs: int = key(2, "Passes over each batch of rollouts.")
    minibatches: int = key(2, "Optimizer steps per pass.")
    clip_eps: float = key(0.2, "Clip of the policy ratio.")
    policy_loss: Literal["ppo_clip", "cispo"] = key(
        "ppo_clip", "ppo_clip: PPO's clipped ratio per token (clip_eps, clip_ratio_c); cispo: "
        "the clipped, stop-gradient ratio times the token's logprob (cispo_clip_high)."
    )
    clip_ratio_c: float = key(
        0.0, "Dual clip (policy_loss = 'ppo_clip'): a token with a negative advantage A loses "
        "at most -clip_ratio_c x A however large its ratio. 0: off; otherwise > 1."
    )
    cispo_clip_high: float = key(
        4.0, "CISPO: upper bound of the importance weight: 1 + high (no lower bound; the "
        "default 4 bounds it at 5, ScaleRL's value)."
    )
    value_clip_eps: float = key(0.2, "Clip of the value update around the old values.")
    vf_coef: float = key(0.5, "Weight of the value loss.")
    gamma: float = key(1.0, "Discount factor of GAE.")
    lam: float = key(0.95, "Lambda of GAE.")
    kl_coef: float = key(0.05, "Per-token KL penalty folded into the reward.")
    whiten_advantages: bool = key(True, "Normalise advantages to zero mean, unit variance.")
    critic_path: str = key(
        "", "A separate model folder for the critic; empty: a value head on a copy of the policy."
    )
    critic_lr: float = key(0.0, "Learning rate of the critic; 0 uses train.lr.")
    engine_is_correction: bool = key(
        False, "Weight each token's loss by the truncated importance ratio min(pi_old / "
        "pi_engine, engine_is_cap) of the policy's and the engine's sampling probabilities, "
        "correcting for an engine that computes with other numerics (e.g. bf16 weights)."
    )
    engine_is_cap: float = key(2.0, "Upper bound (>= 1) of the engine importance weight.")
    max_off_policy_steps: int = key(
        0, "0: sample, then train (synchronous). k >= 1: a producer samples the batches of the "
        "next k steps while the current one trains (as for GRPO). At most 32."
    )


@attrs.frozen
class OPDConfig:
    kind: Literal["opd"] = key("opd", "On-policy distillation: per-token reverse KL to a teacher.")
    mode: Literal["same_tokenizer", "cross_token_multimodal"] = key(
        "same_tokenizer",
        "same_tokenizer: the teacher scores the student's ids; cross_token_multimodal: the "
        "teacher has its own tokenizer and is aligned on character spans.",
    )
    teacher_path: str = key("builtin:tiny-arith-teacher", "The teacher model (folder or builtin:).")
    prompts_per_step: int = key(8, "Prompts drawn from the cursor per step.")
    samples_per_prompt: int = key(2, "Completions sampled per prompt.")
    ppo_epochs: int = key(1, "Passes over each batch of rollouts.")
    clip_eps: float = key(0.2, "Clip of the importance ratio.")
    kl_coef: float = key(1.0, "Weight of the reverse-KL advantage.")
    full_kl: bool = key(
        False, "Add the full-distribution reverse KL as a loss term (same vocabulary only)."
    )
    max_off_policy_steps: int = key(
        0, "0: sample, then train (synchronous). k >= 1: a producer samples the batches of the "
        "next k steps while the current one trains (as for GRPO); the loss's importance ratio "
        "is then taken against the engine's logprobs of the stale samples, clipped at clip_eps. "
        "At most 32."
    )


@attrs.frozen
class SFTConfig:
    kind: Literal["sft"] = key("sft", "Supervised fine-tuning on conversations (mean NLL of the "
                               "trained tokens).")
    examples_per_step: int = key(32, "Conversations per optimizer step (all ranks).")
    loss_on: Literal["assistant", "last_assistant", "all"] = key(
        "assistant", "Which tokens are trained: every assistant turn, the last assistant turn, "
        "or every token of the conversation. A turn's tokens are the ones the chat template "
        "renders for it, found by rendering the conversation prefix by prefix (append-only)."
    )
    max_seq_len: int = key(
        0, "Most tokens of one rendered conversation; 0: rollout.max_model_len when set, else "
        "no limit."
    )
    overlong: Literal["refuse", "drop"] = key(
        "refuse", "A conversation longer than max_seq_len: refuse (the run stops, naming it) or "
        "drop (left out of its step, counted as sft/dropped). Never cut."
    )


@attrs.frozen
class RMConfig:
    kind: Literal["rm"] = key("rm", "Reward model: a scalar score head on the policy "
                              "architecture, trained on preference pairs (Bradley-Terry).")
    pairs_per_step: int = key(16, "Preference pairs per optimizer step (all ranks).")
    center_coef: float = key(
        0.0, "Weight of the penalty mean((r_chosen + r_rejected)^2), which keeps the scores "
        "centred on 0 (the Bradley-Terry loss sees only their differences). 0: off."
    )
    head_lr: float = key(
        0.0, "Peak learning rate of the score head (the linear layer that turns the last hidden "
        "state into the score), on train.lr's schedule and warm-up; 0 uses train.lr. A head new "
        "on a language model starts small, and AdamW moves a weight about one learning rate a "
        "step: at the body's rate the scores take hundreds of steps to separate. Fixed for a "
        "run: a resume that switches between 0 and a value is refused."
    )


AlgoConfig = GRPOConfig | DPOConfig | PPOConfig | OPDConfig | SFTConfig | RMConfig
# kind tag -> config class, read off the union (the converter's tagged-union table); what else
# the package knows of each kind is its spec, runner.recipe.algos.ALGORITHMS.
ALGO_KINDS: dict[str, type] = {attrs.fields(c).kind.default: c for c in get_args(AlgoConfig)}
DEFAULT_KIND = attrs.fields(GRPOConfig).kind.default  # an [algo] table without kind
