"""SFT: the mean negative log-likelihood of the trained tokens.

The loss of a batch is ``-sum_t m_t log p(x_t | x_<t) / sum_t m_t`` over every trained token of
the batch (``m_t``: the loss mask of the shifted grid). A step's loss is taken over the whole
global batch: each micro-batch's mean is weighted by its share of the global batch's trained
tokens (``runner.train.loops.batches.train_minibatch``), so the update does not depend on
``grad_accum_steps`` or the number of ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runner.algorithms.masked import masked_mean, masked_sum, metric


def sft_loss(logprobs_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """(mean NLL over the masked tokens, metrics): ``loss`` (the same mean, detached)."""
    loss = masked_mean(-logprobs_BT, mask_BT)
    return loss, {"loss": metric(loss)}


def nll_sum(logprobs_BT: Tensor, mask_BT: Tensor) -> tuple[float, int]:
    """The summed NLL of the masked tokens and their count (held-out perplexity's parts)."""
    with torch.no_grad():
        return float(masked_sum(-logprobs_BT, mask_BT)), int(mask_BT.sum())
