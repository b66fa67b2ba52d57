"""Advantage estimators of the GRPO family, one function per ``algo.advantage``.

- ``grpo``: reward minus the group mean, divided by the group's (or the batch's) std
  (Shao et al. 2024, arXiv:2402.03300; Dr. GRPO's "none": Liu et al. 2025, arXiv:2503.20783).
- ``rloo``: reward minus the mean of the other members of its group, the leave-one-out baseline
  (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
  arXiv:2402.14740).
- ``reinforce_pp``: REINFORCE++ (Hu 2025, arXiv:2501.03262): each token's return, the
  sequence's reward at its last token minus ``kl_beta`` times the per-token k1 KL
  (log pi_behaviour - log pi_ref) summed from the token to the end, normalised over every
  valid token of the global batch.
- ``reinforce_pp_baseline``: REINFORCE++ with a baseline (same paper): reward minus the group
  mean, normalised over every valid token of the global batch; the KL to the reference stays a
  loss term (``kl_beta`` times k3, as GRPO's).

Pure functions of tensors. The group estimators read every rank's rewards (groups are the
consecutive rows of the global batch) and return this rank's rows; the batch-normalised ones
take the normalisation as a function (``whiten``), the batch's own by default, every rank's in
a run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs
import torch
from torch import Tensor

from runner.algorithms.masked import at_least_float32, masked_sum, masked_whiten

ADV_EPS = 1e-6  # small enough that [1, 0, 0, 1] gives 0.866024 (exact 0.866025) to 1e-5
Scale = Literal["group", "batch", "none"]
Whiten = Callable[[Tensor, Tensor], Tensor]


def _groups(rewards_N: Tensor, group_size: int, min_size: int = 2) -> Tensor:
    """``rewards_N`` in float32 (or float64) as [groups, group_size], checked."""
    if group_size < min_size:
        raise ValueError(f"this estimator needs group_size >= {min_size} (got {group_size}).")
    if rewards_N.ndim != 1 or rewards_N.shape[0] % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size} "
            f"(got shape {tuple(rewards_N.shape)})."
        )
    return at_least_float32(rewards_N).view(-1, group_size)


def group_advantages(rewards_B: Tensor, group_size: int, scale: Scale) -> Tensor:
    """A_i = (r_i - mean_group(r)) / (std + 1e-6): [B] -> [B], B = groups x group_size.

    The rows of one group are consecutive. ``std`` is the unbiased (n - 1) standard deviation
    of the group (scale="group", Shao et al. 2024), of the whole batch (scale="batch"), or the
    division is skipped (scale="none", Dr. GRPO). A group whose rewards are all equal gets
    advantages 0.
    """
    if group_size < 2:
        raise ValueError(f"group_advantages needs group_size >= 2 (got {group_size}).")
    rewards_GN = _groups(rewards_B, group_size)
    centered_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if scale == "group":
        centered_GN = centered_GN / (rewards_GN.std(dim=1, keepdim=True) + ADV_EPS)
    elif scale == "batch":
        centered_GN = centered_GN / (rewards_GN.reshape(-1).std() + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none (got {scale!r}).")
    return centered_GN.reshape(-1)


def rloo_advantages(rewards_B: Tensor, group_size: int) -> Tensor:
    """A_i = r_i - (sum_group(r) - r_i) / (G - 1), the leave-one-out baseline: [B] -> [B].

    Equal to G / (G - 1) times the reward minus the group mean; no division by a std.
    """
    rewards_GN = _groups(rewards_B, group_size)
    others_GN = (rewards_GN.sum(dim=1, keepdim=True) - rewards_GN) / (group_size - 1)
    return (rewards_GN - others_GN).reshape(-1)


def token_returns(score_B: Tensor, mask_BT: Tensor, kl_BT: Tensor | None, kl_beta: float
                  ) -> Tensor:
    """REINFORCE++'s returns with gamma = 1: [B] -> [B, T], 0 outside the mask.

    Token rewards r_t = -kl_beta * kl_t on each valid token plus the sequence's score at its
    last valid token; the return of token t is the sum of the rewards of the valid tokens from
    t to the end (so without KL every valid token's return is the score). Detached.
    """
    mask_BT = mask_BT.to(torch.bool)
    dtype = torch.promote_types(at_least_float32(score_B).dtype,
                                kl_BT.dtype if kl_BT is not None else torch.float32)
    zero = torch.zeros((), dtype=dtype, device=mask_BT.device)
    rewards_BT = torch.zeros(mask_BT.shape, dtype=dtype, device=mask_BT.device)
    if kl_BT is not None and kl_beta > 0:
        rewards_BT = torch.where(mask_BT, -kl_beta * kl_BT.detach().to(dtype), zero)
    cols = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    last_B = torch.where(mask_BT, cols, -1).max(dim=1).values
    has_B = last_B >= 0
    rows_B = torch.arange(mask_BT.shape[0], device=mask_BT.device)[has_B]
    rewards_BT[rows_B, last_B[has_B]] += score_B.detach().to(dtype)[has_B]
    returns_BT = rewards_BT.flip(1).cumsum(1).flip(1)
    return torch.where(mask_BT, returns_BT, zero)


@attrs.frozen(kw_only=True, eq=False)
class AdvantageInputs:
    """What an estimator reads.

    ``rewards_N``: every rank's rewards in global row order (a group's rows consecutive);
    ``rows_B``: this rank's global rows; ``mask_BT``: this rank's loss mask on the logprob grid;
    ``kl_BT``: this rank's per-token log pi_behaviour - log pi_ref (None without a reference);
    ``whiten(x_BT, mask_BT)``: the normalisation over every rank's valid tokens (the default:
    this batch's, ``masked_whiten``).
    """

    rewards_N: Tensor
    rows_B: Tensor
    mask_BT: Tensor
    kl_BT: Tensor | None = None
    group_size: int
    scale: Scale = "group"
    kl_beta: float = 0.0
    whiten: Whiten = masked_whiten


def _grpo(x: AdvantageInputs) -> Tensor:
    return group_advantages(x.rewards_N, x.group_size, x.scale)[x.rows_B]


def _rloo(x: AdvantageInputs) -> Tensor:
    return rloo_advantages(x.rewards_N, x.group_size)[x.rows_B]


def _reinforce_pp(x: AdvantageInputs) -> Tensor:
    score_B = at_least_float32(x.rewards_N)[x.rows_B].to(x.mask_BT.device)
    returns_BT = token_returns(score_B, x.mask_BT, x.kl_BT, x.kl_beta)
    return x.whiten(returns_BT, x.mask_BT.to(torch.bool))


def _reinforce_pp_baseline(x: AdvantageInputs) -> Tensor:
    centered_N = group_advantages(x.rewards_N, x.group_size, "none")
    returns_BT = token_returns(centered_N[x.rows_B].to(x.mask_BT.device), x.mask_BT, None, 0.0)
    return x.whiten(returns_BT, x.mask_BT.to(torch.bool))


@attrs.frozen
class Estimator:
    """One ``algo.advantage``: its function (-> [B] per sequence, or [B, T] per token), and
    whether the KL to the reference is folded into its rewards (then it is no loss term)."""

    fn: Callable[[AdvantageInputs], Tensor]
    kl_in_reward: bool = False


# algo.advantage -> its estimator ("grpo" names the group-normalised estimator here).
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(_grpo),
    "rloo": Estimator(_rloo),
    "reinforce_pp": Estimator(_reinforce_pp, kl_in_reward=True),
    "reinforce_pp_baseline": Estimator(_reinforce_pp_baseline),
}


def advantages(name: str, inputs: AdvantageInputs) -> Tensor:
    """The advantages of this rank's rows by estimator ``name``: [B] or [B, T], detached."""
    return ESTIMATORS[name].fn(inputs).detach()


def abs_sum_count(adv: Tensor, mask_BT: Tensor) -> tuple[float, float]:
    """(sum of |A|, count) over this rank's sequences ([B] advantages) or valid tokens
    ([B, T]): summed over ranks, their ratio is ``adv_abs_mean``."""
    if adv.ndim == 1:
        return float(adv.abs().sum()), float(adv.shape[0])
    return float(masked_sum(adv.abs(), mask_BT)), float(mask_BT.sum())
