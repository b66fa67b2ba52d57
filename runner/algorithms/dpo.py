"""DPO: the preference loss on sequence log-probabilities of chosen and rejected answers.

Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290), its squared IPO
variant (Azar et al. 2023, arXiv:2310.12036) and conservative DPO label smoothing
(Mitchell 2023, "A note on DPO with noisy preferences"), and the NLL-on-chosen term of RPO
(Pang et al. 2024, "Iterative Reasoning Preference Optimization", arXiv:2404.19733; its
``alpha`` is ``algo.sft_weight``). Inputs are summed sequence log-probabilities (see
``runner.algorithms.logprobs.sequence_logprobs``).

The settings are checked once, with the recipe (``runner.recipe.checks``: beta > 0,
label_smoothing in [0, 0.5) and only with the sigmoid loss, sft_weight >= 0); the functions
here take them as given.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from runner.algorithms.masked import metric
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
    chosen_logratio_B = policy_chosen_B - ref_chosen_B
    rejected_logratio_B = policy_rejected_B - ref_rejected_B
    h_B = chosen_logratio_B - rejected_logratio_B
    if loss_type == "sigmoid":
        losses_B = -(1 - label_smoothing) * F.logsigmoid(beta * h_B) - (
            label_smoothing * F.logsigmoid(-beta * h_B)
        )
    elif loss_type == "ipo":
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
    ``chosen_tokens_B`` (the number of completion tokens of each chosen answer) is needed only
    for the NLL term (``cfg.sft_weight > 0``).
    """

    policy_chosen_B: Tensor
    policy_rejected_B: Tensor
    ref_chosen_B: Tensor
    ref_rejected_B: Tensor
    chosen_tokens_B: Tensor | None = None


def chosen_nll(policy_chosen_B: Tensor, chosen_tokens_B: Tensor) -> Tensor:
    """RPO's NLL term: mean over pairs of -log pi(y_w | x) / |y_w| (per-token NLL of each chosen
    answer, then the mean over the batch). [B], [B] -> scalar."""
    return (-policy_chosen_B / chosen_tokens_B.to(policy_chosen_B.dtype)).mean()


def dpo_loss(inputs: DPOLossInputs, cfg: DPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean over pairs of ``dpo_losses`` with cfg.beta, cfg.loss, cfg.label_smoothing, plus
    ``cfg.sft_weight * chosen_nll`` when that weight is not 0:

        loss = mean_b dpo_b + sft_weight * mean_b (-log pi(y_w^b) / |y_w^b|)

    Metrics (detached 0-d tensors): loss (the total), preference_loss (the first term),
    chosen_nll (when chosen_tokens_B is given), reward_margin (mean chosen - rejected reward),
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
    preference_loss = losses_B.mean()
    loss = preference_loss
    nll = None
    if x.chosen_tokens_B is not None:
        nll = chosen_nll(x.policy_chosen_B, x.chosen_tokens_B)
    if cfg.sft_weight:
        if nll is None:
            raise ValueError("algo.sft_weight > 0 needs DPOLossInputs.chosen_tokens_B")
        loss = preference_loss + cfg.sft_weight * nll
    with torch.no_grad():
        metrics = {
            "loss": metric(loss),
            "preference_loss": metric(preference_loss),
            "reward_margin": metric((chosen_B - rejected_B).mean()),
            "accuracy": metric((chosen_B > rejected_B).float().mean()),
            "chosen_reward": metric(chosen_B.mean()),
            "rejected_reward": metric(rejected_B.mean()),
            "chosen_logprob": metric(x.policy_chosen_B.mean()),
            "rejected_logprob": metric(x.policy_rejected_B.mean()),
        }
        if nll is not None:
            metrics["chosen_nll"] = metric(nll)
    return loss, metrics
