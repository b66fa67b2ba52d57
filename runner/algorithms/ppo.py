"""PPO with a learned critic: KL-penalised rewards, GAE, clipped policy and value losses.

Proximal Policy Optimization (Schulman et al. 2017, arXiv:1707.06347) with generalized
advantage estimation (Schulman et al. 2016, arXiv:1506.02438) and the per-token KL reward
penalty of RLHF (Ziegler et al. 2019, arXiv:1909.08593; Ouyang et al. 2022). Each row holds
one sequence, on any grid: right-padded completions, or completions after their prompt on the
shifted grid of a whole sequence. ``mask_BT`` marks the tokens the policy wrote; in a multi-turn
episode it has gaps (the environment's tokens), which GAE steps over: the value of an
assistant token is bootstrapped from the next assistant token, wherever that is.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from torch import Tensor

from runner.algorithms.masked import masked_mean, masked_whiten, metric
from runner.algorithms.policy_loss import POLICY_LOSSES, Clip, clipped_token_loss, policy_metrics
from runner.recipe.schema import PPOConfig


def _last_valid(mask_BT: Tensor) -> Tensor:
    """Column of each row's last masked position (rows must have one)."""
    cols = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    return torch.where(mask_BT, cols, -1).max(dim=1).values


def kl_penalized_rewards(
    score_B: Tensor,
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    mask_BT: Tensor,
    kl_coef: float,
) -> Tensor:
    """r_t = -kl_coef (log pi - log ref)_t, plus score_b at the last valid token: -> [B, T].

    (Ziegler et al. 2019.) Detached; 0 outside the mask. Every row needs >= 1 valid token.
    """
    mask_BT = mask_BT.to(torch.bool)
    lengths_B = mask_BT.sum(dim=1)
    if (lengths_B == 0).any():
        rows = torch.nonzero(lengths_B == 0).flatten().tolist()
        raise ValueError(f"rows {rows} have no valid token to carry their score.")
    kl_BT = (logprobs_BT - ref_logprobs_BT).detach()
    rewards_BT = torch.where(mask_BT, -kl_coef * kl_BT, torch.zeros_like(kl_BT))
    rows_B = torch.arange(rewards_BT.shape[0], device=rewards_BT.device)
    rewards_BT[rows_B, _last_valid(mask_BT)] += score_B.detach().to(rewards_BT.dtype)
    return rewards_BT


def gae(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over each row's masked tokens: -> (adv_BT, returns_BT).

    delta_t = r_t + gamma V_{t'} - V_t,  A_t = delta_t + gamma lam A_{t'},  R_t = A_t + V_t,
    where t' is the row's next masked token after t (the next one on a contiguous run; the
    next assistant token across an environment's answer), with V and A taken as 0 past the last
    one (no bootstrap at the end of a completion). Detached; both outputs are 0 outside the
    mask.
    """
    mask_BT = mask_BT.to(torch.bool)
    zero = torch.zeros((), dtype=values_BT.dtype, device=values_BT.device)
    values_BT = torch.where(mask_BT, values_BT.detach(), zero)
    rewards_BT = torch.where(mask_BT, rewards_BT.detach(), zero)
    adv_BT = torch.zeros_like(values_BT)
    next_value_B = torch.zeros_like(values_BT[:, 0])
    next_adv_B = torch.zeros_like(values_BT[:, 0])
    for t in reversed(range(values_BT.shape[1])):
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        # Off the mask nothing happens: the next masked token's value and advantage carry over.
        next_adv_B = torch.where(mask_BT[:, t], delta_B + gamma * lam * next_adv_B, next_adv_B)
        adv_BT[:, t] = torch.where(mask_BT[:, t], next_adv_B, zero)
        next_value_B = torch.where(mask_BT[:, t], values_BT[:, t], next_value_B)
    returns_BT = torch.where(mask_BT, adv_BT + values_BT, zero)
    return adv_BT, returns_BT


def ppo_advantages(
    score_B: Tensor,
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    values_BT: Tensor,
    mask_BT: Tensor,
    cfg: PPOConfig,
    whiten: Callable[[Tensor, Tensor], Tensor] = masked_whiten,
) -> tuple[Tensor, Tensor]:
    """Rollout-time step: KL-penalised rewards -> GAE -> optional whitening: (adv_BT, returns_BT).

    Call once per batch of rollouts (whitening uses the whole batch: ``whiten`` is
    ``masked_whiten`` of this batch, or a whitening over every rank's), before minibatching.
    Returns are computed from the un-whitened advantages.
    """
    rewards_BT = kl_penalized_rewards(score_B, logprobs_BT, ref_logprobs_BT, mask_BT, cfg.kl_coef)
    adv_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        adv_BT = whiten(adv_BT, mask_BT.to(torch.bool))
    return adv_BT, returns_BT


def clipped_policy_token_loss(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, adv_BT: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """-min(r A, clip(r, 1 - eps, 1 + eps) A), r = exp(lp - old): -> (loss_BT, clipped_BT).

    The symmetric case of ``grpo.clipped_token_loss`` (Schulman et al. 2017).
    """
    return clipped_token_loss(logprobs_BT, old_logprobs_BT, adv_BT, eps, eps)


def clipped_policy_loss(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, eps: float,
    is_weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked token mean of ``clipped_policy_token_loss`` (each token's term times
    ``is_weights_BT`` when given, see ``grpo.engine_is_weights``): -> (loss, metrics).

    ``policy_loss`` with "ppo_clip" and the symmetric bounds ``eps``.
    """
    return policy_loss(logprobs_BT, old_logprobs_BT, adv_BT, mask_BT, "ppo_clip", Clip(eps, eps),
                       is_weights_BT)


def policy_loss(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, name: str,
    clip: Clip, is_weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked token mean of the policy loss ``POLICY_LOSSES[name]`` with bounds ``clip`` (each
    token's term times ``is_weights_BT`` when given): -> (loss, metrics).

    Metrics: policy_loss, clip_frac, ratio_mean, approx_kl (masked mean of the k3 estimate
    of KL(old || new)) and the bounds' fractions (``policy_metrics``).
    """
    terms = POLICY_LOSSES[name](logprobs_BT, old_logprobs_BT, adv_BT, mask_BT, clip)
    loss_BT = terms.loss_BT
    if is_weights_BT is not None:
        loss_BT = loss_BT * is_weights_BT
    loss = masked_mean(loss_BT, mask_BT)
    with torch.no_grad():
        log_ratio_BT = logprobs_BT - old_logprobs_BT
        metrics = {
            "policy_loss": metric(loss),
            "ratio_mean": metric(masked_mean(torch.exp(log_ratio_BT), mask_BT)),
            "approx_kl": metric(masked_mean(torch.exp(log_ratio_BT) - 1 - log_ratio_BT, mask_BT)),
            **policy_metrics(terms, mask_BT),
        }
    return loss, metrics


def clipped_value_loss(
    values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, eps: float
) -> Tensor:
    """Masked mean of 0.5 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2): -> [].

    The clipped value objective of PPO2 (OpenAI baselines; Schulman et al. 2017).
    """
    clipped_BT = old_values_BT + torch.clamp(values_BT - old_values_BT, -eps, eps)
    loss_BT = 0.5 * torch.maximum((values_BT - returns_BT) ** 2, (clipped_BT - returns_BT) ** 2)
    return masked_mean(loss_BT, mask_BT)


@attrs.frozen(kw_only=True, eq=False)
class PPOLossInputs:
    """One micro-batch for ``ppo_loss``; every tensor is [B, T].

    ``adv_BT``, ``returns_BT`` and ``old_values_BT`` come from ``ppo_advantages`` and the
    rollout-time critic; ``values_BT`` is the critic's current output (with gradient).
    """

    logprobs_BT: Tensor
    old_logprobs_BT: Tensor
    adv_BT: Tensor
    mask_BT: Tensor
    values_BT: Tensor
    old_values_BT: Tensor
    returns_BT: Tensor
    is_weights_BT: Tensor | None = None


# algo.policy_loss -> its bounds, read from PPO's keys (CISPO: no lower bound, as for GRPO).
CLIPS: dict[str, Callable[[PPOConfig], Clip]] = {
    "ppo_clip": lambda c: Clip(c.clip_eps, c.clip_eps, c.clip_ratio_c),
    "cispo": lambda c: Clip(1.0, c.cispo_clip_high),
}


def ppo_loss(inputs: PPOLossInputs, cfg: PPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = policy_loss(cfg.policy_loss) + vf_coef * clipped_value_loss(eps=value_clip_eps).

    (Schulman et al. 2017, eq. 9 without the entropy bonus; "ppo_clip" clips at clip_eps.)
    Metrics: those of ``policy_loss`` plus value_loss and loss.
    """
    x = inputs
    pg_loss, metrics = policy_loss(
        x.logprobs_BT, x.old_logprobs_BT, x.adv_BT, x.mask_BT, cfg.policy_loss,
        CLIPS[cfg.policy_loss](cfg), x.is_weights_BT
    )
    value_loss = clipped_value_loss(
        x.values_BT, x.old_values_BT, x.returns_BT, x.mask_BT, cfg.value_clip_eps
    )
    loss = pg_loss + cfg.vf_coef * value_loss
    metrics["value_loss"] = metric(value_loss.detach())
    metrics["loss"] = metric(loss.detach())
    return loss, metrics
