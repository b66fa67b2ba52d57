"""GRPO: the loss of the GRPO family, its aggregations and the engine importance weights.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) with
the asymmetric "clip-higher" of DAPO (Yu et al. 2025, arXiv:2503.14476) and the constant
normaliser of Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training",
arXiv:2503.20783). The advantage estimators are ``runner.algorithms.advantages`` (one per
``algo.advantage``), the per-token policy losses ``runner.algorithms.policy_loss`` (one per
``algo.policy_loss``); the loss picks them by name from their tables. Pure functions of
tensors; no model, no device choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import torch
from torch import Tensor

from runner.algorithms.advantages import ADV_EPS, ESTIMATORS, group_advantages
from runner.algorithms.masked import masked_mean, masked_sum, metric
from runner.algorithms.policy_loss import POLICY_LOSSES, Clip, clipped_token_loss, policy_metrics
from runner.recipe.schema import GRPOConfig

Aggregation = Literal["token_mean", "seq_mean", "seq_mean_token_sum", "dr_grpo"]
__all__ = ["ADV_EPS", "GRPOLossInputs", "aggregate", "clipped_token_loss", "engine_is_weights",
           "group_advantages", "grpo_loss", "k3_kl", "row_weights"]


def k3_kl(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per sampled token: [B, T] -> [B, T].

    k3 = exp(d) - d - 1 with d = log pi_ref - log pi; unbiased, always >= 0
    (J. Schulman, "Approximating KL Divergence", 2020).
    """
    d_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(d_BT) - d_BT - 1


def aggregate(loss_BT: Tensor, mask_BT: Tensor, mode: Aggregation, max_tokens: int) -> Tensor:
    """Reduce per-token losses to a scalar: [B, T] -> [].

    token_mean:         sum_{b,t} m l / sum_{b,t} m (DAPO);
    seq_mean:           mean over rows with >= 1 token of (sum_t m l / sum_t m) (GRPO, Shao et
                        al.); rows with no token are left out of the mean;
    seq_mean_token_sum: mean over rows with >= 1 token of sum_t m l (the sequence's summed loss;
                        REINFORCE-style, as verl's "seq-mean-token-sum");
    dr_grpo:            sum_{b,t} m l / (B * max_tokens), a constant normaliser (Liu et al. 2025).
    Every mode gives 0, not NaN, when the mask is empty.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"mode must be one of {', '.join(AGGREGATIONS)} (got {mode!r}).")
    return AGGREGATIONS[mode](loss_BT, mask_BT, max_tokens)


def _rows_mean(row_B: Tensor, mask_BT: Tensor) -> Tensor:
    return masked_mean(row_B, mask_BT.to(torch.bool).any(dim=1))


def _dr_grpo(loss_BT: Tensor, mask_BT: Tensor, max_tokens: int) -> Tensor:
    if max_tokens < 1:
        raise ValueError(f"dr_grpo needs max_tokens >= 1 (got {max_tokens}).")
    return masked_sum(loss_BT, mask_BT) / (loss_BT.shape[0] * max_tokens)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int], Tensor]] = {
    "token_mean": lambda loss_BT, mask_BT, _: masked_mean(loss_BT, mask_BT),
    "seq_mean": lambda loss_BT, mask_BT, _: _rows_mean(masked_mean(loss_BT, mask_BT, dim=1),
                                                       mask_BT),
    "seq_mean_token_sum": lambda loss_BT, mask_BT, _: _rows_mean(
        masked_sum(loss_BT, mask_BT, dim=1), mask_BT),
    "dr_grpo": _dr_grpo,
}


# Each row's part of the normaliser of a minibatch, from its valid tokens: the tokens
# (token_mean), 1 for a row with a token (the sequence means leave rows with none out), 1 for
# every row (dr_grpo's constant counts every sequence).
ROW_WEIGHTS: dict[str, Callable[[float], float]] = {
    "token_mean": float, "seq_mean": lambda n: float(n > 0),
    "seq_mean_token_sum": lambda n: float(n > 0), "dr_grpo": lambda n: 1.0,
}


def row_weights(mode: Aggregation, tokens: Sequence[float]) -> list[float]:
    """The rows' weights under ``mode`` (``ROW_WEIGHTS``): a micro-batch's loss times its rows'
    share of the minibatch's total weight is its part of the minibatch's loss."""
    return [ROW_WEIGHTS[mode](t) for t in tokens]


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

    ``adv_B`` is [B] (one advantage per sequence) or [B, T] (per token: REINFORCE++).
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


# algo.policy_loss -> its bounds, read from GRPO's keys. CISPO has no lower bound (MiniMax-M1
# sets it out of reach and tunes the upper one only): 1 - 1.0 = 0 never binds a ratio.
CLIPS: dict[str, Callable[[GRPOConfig], Clip]] = {
    "ppo_clip": lambda c: Clip(c.clip_eps_low, c.clip_eps_high, c.clip_ratio_c),
    "gspo": lambda c: Clip(c.gspo_clip_low, c.gspo_clip_high),
    "cispo": lambda c: Clip(1.0, c.cispo_clip_high),
}


def grpo_loss(inputs: GRPOLossInputs, cfg: GRPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss: aggregate(policy loss + kl_beta * k3_kl) with cfg.loss_agg.

    The policy loss per token is ``POLICY_LOSSES[cfg.policy_loss]`` with the bounds
    ``CLIPS[cfg.policy_loss](cfg)`` (ppo_clip: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),
    Shao et al. 2024), times the engine importance weights when given. The k3 KL to the
    reference is a loss term unless the advantage estimator folded it into the rewards
    (``ESTIMATORS[cfg.advantage].kl_in_reward``). Metrics (detached 0-d tensors): loss,
    pg_loss, clip_frac, ratio_mean, the bounds' fractions and GSPO's sequence ratios
    (``policy_metrics``), and kl when reference logprobs are given.
    """
    x = inputs
    terms = POLICY_LOSSES[cfg.policy_loss](x.logprobs_BT, x.old_logprobs_BT, x.adv_B, x.mask_BT,
                                           CLIPS[cfg.policy_loss](cfg))
    pg_BT = terms.loss_BT
    if x.is_weights_BT is not None:
        pg_BT = pg_BT * x.is_weights_BT
    loss_BT = pg_BT
    kl_BT = None
    if x.ref_logprobs_BT is not None:
        kl_BT = k3_kl(x.logprobs_BT, x.ref_logprobs_BT)
        if cfg.kl_beta > 0 and not ESTIMATORS[cfg.advantage].kl_in_reward:
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
            "ratio_mean": metric(masked_mean(torch.exp(x.logprobs_BT - x.old_logprobs_BT), m)),
            **policy_metrics(terms, m),
        }
        if kl_BT is not None:
            metrics["kl"] = metric(masked_mean(kl_BT, m))
        if x.is_weights_BT is not None:
            metrics["engine_is_weight"] = metric(masked_mean(x.is_weights_BT, m))
    return loss, metrics
