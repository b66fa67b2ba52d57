"""Per-token and per-sequence log-probabilities from logits.

The caller aligns labels with logits (``labels_BT[:, t]`` is the token predicted by
``logits_BTV[:, t]``, i.e. the usual shift by one is already done).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runner.algorithms.masked import at_least_float32, masked_sum


def token_logprobs(logits_BTV: Tensor, labels_BT: Tensor) -> Tensor:
    """log softmax(logits)[label] per position, >= float32: [B, T, V], [B, T] -> [B, T].

    Negative labels (the -100 ignore index) are read as token 0; their values are meaningless
    and must be masked out by the caller.
    """
    logp_BTV = torch.log_softmax(at_least_float32(logits_BTV), dim=-1)
    index_BT1 = labels_BT.clamp(min=0).unsqueeze(-1)
    return logp_BTV.gather(-1, index_BT1).squeeze(-1)


def sequence_logprobs(logits_BTV: Tensor, labels_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log p(y | x) = sum_t m_t log p(y_t | y_<t, x): [B, T, V], [B, T], [B, T] -> [B]."""
    return masked_sum(token_logprobs(logits_BTV, labels_BT), mask_BT, dim=1)
