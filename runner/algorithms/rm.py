"""Reward model: the Bradley-Terry loss on the scores of chosen and rejected answers.

A reward model gives each (prompt, answer) one scalar score r. Bradley-Terry (Bradley and Terry
1952; as in Ouyang et al. 2022, arXiv:2203.02155) models the chance that the chosen answer is
preferred as sigma(r_c - r_r), so the loss of a batch of pairs is

    loss = mean_b -log sigma(r_c^b - r_r^b - m^b) + center_coef * mean_b (r_c^b + r_r^b)^2

where m^b is pair b's given margin (``data.margin_column``; 0 without one): the chosen answer
must score about m^b above the rejected one before the pair stops pulling (the margin loss of
Touvron et al. 2023, arXiv:2307.09288). The second term (0 when ``center_coef`` is 0) keeps the
scores centred on 0, which the first term, seeing only differences, leaves free (Eisenstein et
al. 2023, arXiv:2312.09244). The settings are checked with the recipe (``center_coef >= 0``);
the function takes them as given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runner.algorithms.masked import metric


def rm_loss(chosen_B: Tensor, rejected_B: Tensor, center_coef: float = 0.0,
            given_B: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """(the loss above, metrics) of the scores ``chosen_B`` and ``rejected_B`` ([B] each), with
    the pairs' given margins ``given_B`` ([B]; None: 0).

    Metrics (detached 0-d tensors): loss (the total), bt_loss (the first term), accuracy (the
    share of pairs with r_c > r_r, a tie counting half), margin (mean r_c - r_r: the scores'
    margin, the given one not subtracted), chosen_score and rejected_score (means)."""
    margin_B = chosen_B - rejected_B
    logits_B = margin_B if given_B is None else margin_B - given_B.to(margin_B)
    bt_loss = -F.logsigmoid(logits_B).mean()
    loss = bt_loss + center_coef * ((chosen_B + rejected_B) ** 2).mean() if center_coef \
        else bt_loss
    with torch.no_grad():
        metrics = {
            "loss": metric(loss),
            "bt_loss": metric(bt_loss),
            "accuracy": metric(pair_accuracy(margin_B)),
            "margin": metric(margin_B.mean()),
            "chosen_score": metric(chosen_B.mean()),
            "rejected_score": metric(rejected_B.mean()),
        }
    return loss, metrics


def pair_accuracy(margin_B: Tensor) -> Tensor:
    """The share of pairs ranked right (margin > 0), a tie counting half: a 0-d tensor."""
    return ((margin_B > 0).to(margin_B.dtype) + 0.5 * (margin_B == 0).to(margin_B.dtype)).mean()
