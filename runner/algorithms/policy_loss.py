"""Policy-gradient token losses of the GRPO family, one function per ``algo.policy_loss``.

- ``ppo_clip``: the clipped surrogate of PPO (Schulman et al. 2017, arXiv:1707.06347) on each
  token's ratio, with DAPO's asymmetric bounds (Yu et al. 2025, arXiv:2503.14476) and the dual
  clip for negative advantages (Ye et al. 2020, arXiv:1912.09729).
- ``gspo``: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071): the
  sequence's ratio s = exp(mean over its valid tokens of log pi - log pi_old), clipped per
  sequence, in the token form of the paper (GSPO-token): s_t = sg(s) pi_t / sg(pi_t), whose
  value is s and whose gradient is s grad log pi_t, so every token of a sequence has the same
  weight.
- ``cispo``: CISPO (MiniMax-M1, arXiv:2506.13585): -sg(clip(r, 1 - low, 1 + high)) A log pi on
  every token; the clip bounds the importance weight and drops no token's gradient.

Each takes (logprobs, old logprobs, advantages [B] or [B, T], mask, ``Clip``) and returns
``PolicyTerms``: the per-token loss (the negated objective, before aggregation) and the flags
of the tokens each bound acted on. Pure functions of tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from torch import Tensor

from runner.algorithms.masked import masked_mean


@attrs.frozen
class Clip:
    """The bounds of a policy loss: the ratio is clipped to [1 - low, 1 + high]; ``dual_c`` > 1
    bounds the loss of a token with A < 0 by -c A (0: no dual clip)."""

    low: float
    high: float
    dual_c: float = 0.0


@attrs.frozen(eq=False)
class PolicyTerms:
    """A policy loss per token and what its bounds did.

    ``low_BT`` / ``high_BT`` (bool): tokens whose ratio (or weight) the lower / upper bound
    clipped, counted where the clip acts on the gradient (ppo_clip, gspo: A < 0 below, A > 0
    above; cispo: any token whose weight is clipped). ``dual_BT``: tokens the dual clip bounded
    (None when it is off). ``seq_ratio_B``: GSPO's sequence ratios (None otherwise).
    """

    loss_BT: Tensor
    low_BT: Tensor
    high_BT: Tensor
    dual_BT: Tensor | None = None
    seq_ratio_B: Tensor | None = None


def _per_token(adv: Tensor) -> Tensor:
    return adv.unsqueeze(-1) if adv.ndim == 1 else adv


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
    return _clipped(torch.exp(logprobs_BT - old_logprobs_BT), _per_token(adv), eps_low, eps_high)


def _clipped(ratio_BT: Tensor, adv_BT: Tensor, eps_low: float, eps_high: float
             ) -> tuple[Tensor, Tensor]:
    unclipped_BT = ratio_BT * adv_BT
    clipped_obj_BT = torch.clamp(ratio_BT, 1 - eps_low, 1 + eps_high) * adv_BT
    loss_BT = -torch.minimum(unclipped_BT, clipped_obj_BT)
    clipped_BT = ((adv_BT > 0) & (ratio_BT > 1 + eps_high)) | (
        (adv_BT < 0) & (ratio_BT < 1 - eps_low)
    )
    return loss_BT, clipped_BT


def _terms(ratio_BT: Tensor, adv_BT: Tensor, clip: Clip, seq_ratio_B: Tensor | None = None
           ) -> PolicyTerms:
    """The clipped surrogate of ``ratio_BT`` with its flags, and the dual clip when on."""
    loss_BT, clipped_BT = _clipped(ratio_BT, adv_BT, clip.low, clip.high)
    negative_BT = adv_BT < 0
    dual_BT = None
    if clip.dual_c > 0:
        bound_BT = -clip.dual_c * adv_BT
        dual_BT = (negative_BT & (loss_BT > bound_BT)).expand_as(loss_BT)
        loss_BT = torch.where(negative_BT, torch.minimum(loss_BT, bound_BT), loss_BT)
    return PolicyTerms(loss_BT, clipped_BT & negative_BT, clipped_BT & (adv_BT > 0), dual_BT,
                       seq_ratio_B)


def ppo_clip(logprobs_BT: Tensor, old_logprobs_BT: Tensor, adv: Tensor, mask_BT: Tensor,
             clip: Clip) -> PolicyTerms:
    """-min(r A, clip(r, 1 - low, 1 + high) A) per token, r = exp(lp - old); with the dual clip
    (c > 1) a token with A < 0 has loss min(that, -c A), i.e. its objective is at least c A."""
    return _terms(torch.exp(logprobs_BT - old_logprobs_BT), _per_token(adv), clip)


def sequence_ratios(logprobs_BT: Tensor, old_logprobs_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """GSPO's s_b = exp(mean over row b's valid tokens of (lp - old)): [B, T] -> [B] (1 for a
    row with no valid token)."""
    return torch.exp(masked_mean(logprobs_BT - old_logprobs_BT, mask_BT, dim=1))


def gspo(logprobs_BT: Tensor, old_logprobs_BT: Tensor, adv: Tensor, mask_BT: Tensor,
         clip: Clip) -> PolicyTerms:
    """GSPO-token: the clipped surrogate of s_t = sg(s_b) exp(lp_t - sg(lp_t)) (value s_b,
    gradient s_b grad lp_t), clipped to [1 - low, 1 + high] like a token ratio."""
    seq_B = sequence_ratios(logprobs_BT, old_logprobs_BT, mask_BT)
    ratio_BT = seq_B.detach().unsqueeze(-1) * torch.exp(logprobs_BT - logprobs_BT.detach())
    return _terms(ratio_BT, _per_token(adv), clip, seq_B.detach())


def cispo(logprobs_BT: Tensor, old_logprobs_BT: Tensor, adv: Tensor, mask_BT: Tensor,
          clip: Clip) -> PolicyTerms:
    """-sg(clip(r, 1 - low, 1 + high)) A lp per token: the gradient is the clipped weight times
    A grad lp on every token (none dropped)."""
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT).detach()
    weight_BT = torch.clamp(ratio_BT, 1 - clip.low, 1 + clip.high)
    loss_BT = -weight_BT * _per_token(adv) * logprobs_BT
    return PolicyTerms(loss_BT, ratio_BT < 1 - clip.low, ratio_BT > 1 + clip.high)


PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, Clip], PolicyTerms]
POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}


def policy_metrics(terms: PolicyTerms, mask_BT: Tensor) -> dict[str, Tensor]:
    """The bounds' token fractions (``clip_frac``: either bound; ``loss/clip_frac_low``,
    ``loss/clip_frac_high``; ``loss/dual_clip_frac`` with the dual clip) and GSPO's sequence
    ratios over the rows with a valid token (``loss/seq_ratio_mean``, ``_min``, ``_max``).
    Detached 0-d tensors."""
    m = mask_BT
    out = {"clip_frac": masked_mean((terms.low_BT | terms.high_BT).float(), m),
           "loss/clip_frac_low": masked_mean(terms.low_BT.float(), m),
           "loss/clip_frac_high": masked_mean(terms.high_BT.float(), m)}
    if terms.dual_BT is not None:
        out["loss/dual_clip_frac"] = masked_mean(terms.dual_BT.float(), m)
    if terms.seq_ratio_B is not None:
        seq_B, has_B = terms.seq_ratio_B, m.to(torch.bool).any(dim=1)
        out |= {"loss/seq_ratio_mean": torch.where(has_B.any(), masked_mean(seq_B, has_B), 1.0),
                "loss/seq_ratio_min": _extreme(seq_B, has_B, torch.amin, float("inf")),
                "loss/seq_ratio_max": _extreme(seq_B, has_B, torch.amax, float("-inf"))}
    return {k: v.detach() for k, v in out.items()}


def _extreme(x_B: Tensor, keep_B: Tensor, reduce: Callable[[Tensor], Tensor], fill: float
             ) -> Tensor:
    """``reduce`` (amin / amax) of the kept elements, 1 when none is kept; no host sync."""
    out = reduce(torch.where(keep_B, x_B, torch.full_like(x_B, fill)))
    return torch.where(keep_B.any(), out, torch.ones_like(out))
