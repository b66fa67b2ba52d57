"""DPO: the preference loss on sequence log-probabilities of chosen and rejected answers.

Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290), its squared IPO
variant (Azar et al. 2023, arXiv:2310.12036) and conservative DPO label smoothing
(Mitchell 2023, "A note on DPO with noisy preferences"). Inputs are summed sequence
log-probabilities (see ``runner.algorithms.logprobs.sequence_logprobs``).
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from runner.recipe.schema import DPOConfig

LossType = Literal["sigmoid", "ipo"]


def dpo_losses(
    policy_chosen_B: Tensor,
    policy_rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    beta: float,
    loss_type: LossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair DPO losses and implicit rewards: four [B] -> (losses_B, chosen_B, rejected_B).

    h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))
    sigmoid: loss = -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)
    ipo:     loss = (h - 1 / (2 beta))^2   (label smoothing does not apply)
    Rewards are beta (log pi - log ref) of each answer, detached.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (got {beta}).")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5] (got {label_smoothing}).")
    chosen_logratio_B = policy_chosen_B - ref_chosen_B
    rejected_logratio_B = policy_rejected_B - ref_rejected_B
    h_B = chosen_logratio_B - rejected_logratio_B
    if loss_type == "sigmoid":
        losses_B = -(1 - label_smoothing) * F.logsigmoid(beta * h_B) - (
            label_smoothing * F.logsigmoid(-beta * h_B)
        )
    elif loss_type == "ipo":
        if label_smoothing:
            raise ValueError(
                f"label_smoothing = {label_smoothing} applies to the sigmoid loss only; "
                "set algo.label_smoothing = 0 with algo.loss = 'ipo'."
            )
        losses_B = (h_B - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be sigmoid or ipo (got {loss_type!r}).")
    chosen_rewards_B = beta * chosen_logratio_B.detach()
    rejected_rewards_B = beta * rejected_logratio_B.detach()
    return losses_B, chosen_rewards_B, rejected_rewards_B


@attrs.frozen(kw_only=True, eq=False)
class DPOLossInputs:
    """Summed sequence log-probabilities of one batch of pairs, each [B].

    The reference ones carry no gradient (computed under no_grad or precomputed).
    """

    policy_chosen_B: Tensor
    policy_rejected_B: Tensor
    ref_chosen_B: Tensor
    ref_rejected_B: Tensor


def dpo_loss(inputs: DPOLossInputs, cfg: DPOConfig) -> tuple[Tensor, dict[str, float]]:
    """Mean over pairs of ``dpo_losses`` with cfg.beta, cfg.loss, cfg.label_smoothing.

    Metrics (python floats, no grad): loss, reward_margin (mean chosen - rejected reward),
    accuracy (fraction of pairs with chosen reward > rejected reward), chosen_reward,
    rejected_reward, chosen_logprob and rejected_logprob (policy, mean over pairs).
    """
    x = inputs
    losses_B, chosen_B, rejected_B = dpo_losses(
        x.policy_chosen_B,
        x.policy_rejected_B,
        x.ref_chosen_B,
        x.ref_rejected_B,
        cfg.beta,
        cfg.loss,
        cfg.label_smoothing,
    )
    loss = losses_B.mean()
    with torch.no_grad():
        metrics = {
            "loss": float(loss),
            "reward_margin": float((chosen_B - rejected_B).mean()),
            "accuracy": float((chosen_B > rejected_B).float().mean()),
            "chosen_reward": float(chosen_B.mean()),
            "rejected_reward": float(rejected_B.mean()),
            "chosen_logprob": float(x.policy_chosen_B.mean()),
            "rejected_logprob": float(x.policy_rejected_B.mean()),
        }
    return loss, metrics
