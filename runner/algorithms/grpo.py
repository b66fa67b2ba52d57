"""GRPO: group-relative advantages and the clipped token-level policy-gradient loss.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) with
the asymmetric "clip-higher" of DAPO (Yu et al. 2025, arXiv:2503.14476) and the constant
normaliser of Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training",
arXiv:2503.20783). Pure functions of tensors; no model, no device choice.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
from torch import Tensor

from runner.algorithms.masked import at_least_float32, masked_mean, masked_sum, metric
from runner.recipe.schema import GRPOConfig

ADV_EPS = 1e-6  # small enough that [1, 0, 0, 1] gives 0.866024 (exact 0.866025) to 1e-5
Scale = Literal["group", "batch", "none"]
Aggregation = Literal["token_mean", "seq_mean", "dr_grpo"]


def group_advantages(rewards_B: Tensor, group_size: int, scale: Scale) -> Tensor:
    """A_i = (r_i - mean_group(r)) / (std + 1e-6): [B] -> [B], B = groups x group_size.

    The rows of one group are consecutive. ``std`` is the unbiased (n - 1) standard deviation
    of the group (scale="group", Shao et al. 2024), of the whole batch (scale="batch"), or the
    division is skipped (scale="none", Dr. GRPO). A group whose rewards are all equal gets
    advantages 0.
    """
    if group_size < 2:
        raise ValueError(f"group_advantages needs group_size >= 2 (got {group_size}).")
    if rewards_B.ndim != 1 or rewards_B.shape[0] % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size} "
            f"(got shape {tuple(rewards_B.shape)})."
        )
    rewards_B = at_least_float32(rewards_B)
    rewards_GN = rewards_B.view(-1, group_size)
    centered_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if scale == "group":
        centered_GN = centered_GN / (rewards_GN.std(dim=1, keepdim=True) + ADV_EPS)
    elif scale == "batch":
        centered_GN = centered_GN / (rewards_B.std() + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none (got {scale!r}).")
    return centered_GN.reshape(-1)


def k3_kl(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per sampled token: [B, T] -> [B, T].

    k3 = exp(d) - d - 1 with d = log pi_ref - log pi; unbiased, always >= 0
    (J. Schulman, "Approximating KL Divergence", 2020).
    """
    d_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(d_BT) - d_BT - 1


def clipped_token_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    adv: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token, negated: returns (loss_BT, clipped_BT).

    loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(logprobs - old_logprobs)
    (Schulman et al. 2017, arXiv:1707.06347; asymmetric bounds: DAPO). ``adv`` is [B]
    (one advantage per sequence, broadcast over T) or [B, T]. ``clipped_BT`` (bool) marks the
    tokens whose gradient the clip removes: A > 0 and r > 1 + eps_high, or A < 0 and
    r < 1 - eps_low.
    """
    adv_BT = adv.unsqueeze(-1) if adv.ndim == 1 else adv
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT)
    unclipped_BT = ratio_BT * adv_BT
    clipped_obj_BT = torch.clamp(ratio_BT, 1 - eps_low, 1 + eps_high) * adv_BT
    loss_BT = -torch.minimum(unclipped_BT, clipped_obj_BT)
    clipped_BT = ((adv_BT > 0) & (ratio_BT > 1 + eps_high)) | (
        (adv_BT < 0) & (ratio_BT < 1 - eps_low)
    )
    return loss_BT, clipped_BT


def aggregate(loss_BT: Tensor, mask_BT: Tensor, mode: Aggregation, max_tokens: int) -> Tensor:
    """Reduce per-token losses to a scalar: [B, T] -> [].

    token_mean: sum_{b,t} m l / sum_{b,t} m (DAPO);
    seq_mean:   mean over rows with >= 1 token of (sum_t m l / sum_t m) (GRPO, Shao et al.);
                rows with no token are left out of the mean;
    dr_grpo:    sum_{b,t} m l / (B * max_tokens), a constant normaliser (Liu et al. 2025).
    Every mode gives 0, not NaN, when the mask is empty.
    """
    if mode == "token_mean":
        return masked_mean(loss_BT, mask_BT)
    if mode == "seq_mean":
        row_mean_B = masked_mean(loss_BT, mask_BT, dim=1)
        has_tokens_B = mask_BT.to(torch.bool).any(dim=1)
        return masked_mean(row_mean_B, has_tokens_B)
    if mode == "dr_grpo":
        if max_tokens < 1:
            raise ValueError(f"dr_grpo needs max_tokens >= 1 (got {max_tokens}).")
        return masked_sum(loss_BT, mask_BT) / (loss_BT.shape[0] * max_tokens)
    raise ValueError(f"mode must be token_mean, seq_mean or dr_grpo (got {mode!r}).")


def engine_is_weights(old_logprobs_BT: Tensor, engine_logprobs_BT: Tensor, cap: float) -> Tensor:
    """Truncated importance weights of the policy over the engine that sampled: [B, T] -> [B, T].

    w = min(pi_old / pi_engine, cap) = min(exp(old - engine), cap), no gradient. When the
    engine's numerics differ from the policy's (bf16 weights, another kernel), the sampled tokens
    follow pi_engine while the loss assumes pi_old; weighting each token's policy-gradient term
    by w corrects the expectation, and the cap bounds the variance (truncated importance
    sampling, Ionides 2008; as in the off-policy corrections of RL fine-tuning with vLLM).
    """
    with torch.no_grad():
        return torch.exp(old_logprobs_BT - engine_logprobs_BT).clamp(max=cap)


@attrs.frozen(kw_only=True, eq=False)
class GRPOLossInputs:
    """One micro-batch for ``grpo_loss``; every tensor is [B, T] except ``adv_B``.

    ``max_tokens`` is rollout.max_new_tokens (the dr_grpo normaliser). ``ref_logprobs_BT`` is
    None when kl_beta = 0 (no reference model is run). ``is_weights_BT`` (optional, no
    gradient) multiplies each token's policy-gradient term (``engine_is_weights``).
    """

    logprobs_BT: Tensor
    old_logprobs_BT: Tensor
    ref_logprobs_BT: Tensor | None = None
    adv_B: Tensor
    mask_BT: Tensor
    max_tokens: int
    is_weights_BT: Tensor | None = None


def grpo_loss(inputs: GRPOLossInputs, cfg: GRPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss: aggregate(clipped_token_loss + kl_beta * k3_kl) with cfg.loss_agg.

    l_bt = -min(r A_b, clip(r, 1 - eps_low, 1 + eps_high) A_b) + beta k3(pi, pi_ref)
    (Shao et al. 2024, arXiv:2402.03300). Metrics (detached 0-d tensors): loss, pg_loss,
    clip_frac, ratio_mean (masked token means), and kl when reference logprobs are given.
    """
    x = inputs
    pg_BT, clipped_BT = clipped_token_loss(
        x.logprobs_BT, x.old_logprobs_BT, x.adv_B, cfg.clip_eps_low, cfg.clip_eps_high
    )
    if x.is_weights_BT is not None:
        pg_BT = pg_BT * x.is_weights_BT
    loss_BT = pg_BT
    kl_BT = None
    if x.ref_logprobs_BT is not None:
        kl_BT = k3_kl(x.logprobs_BT, x.ref_logprobs_BT)
        if cfg.kl_beta > 0:
            loss_BT = pg_BT + cfg.kl_beta * kl_BT
    elif cfg.kl_beta > 0:
        raise ValueError(
            f"algo.kl_beta = {cfg.kl_beta} needs reference logprobs (ref_logprobs_BT is None); "
            "run the reference model or set algo.kl_beta = 0."
        )
    loss = aggregate(loss_BT, x.mask_BT, cfg.loss_agg, x.max_tokens)
    with torch.no_grad():
        m = x.mask_BT
        metrics = {
            "loss": metric(loss),
            "pg_loss": metric(aggregate(pg_BT, m, cfg.loss_agg, x.max_tokens)),
            "clip_frac": metric(masked_mean(clipped_BT.float(), m)),
            "ratio_mean": metric(masked_mean(torch.exp(x.logprobs_BT - x.old_logprobs_BT), m)),
        }
        if kl_BT is not None:
            metrics["kl"] = metric(masked_mean(kl_BT, m))
        if x.is_weights_BT is not None:
            metrics["engine_is_weight"] = metric(masked_mean(x.is_weights_BT, m))
    return loss, metrics
