"""Per-token and per-sequence log-probabilities from logits.

The caller aligns labels with logits (``labels_BT[:, t]`` is the token predicted by
``logits_BTV[:, t]``, i.e. the usual shift by one is already done).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from runner.algorithms.masked import at_least_float32, masked_sum

# Above this many logits (or for bf16/fp16 logits) the chunked path is taken: it never holds a
# float32 copy of more than CHUNK_ELEMENTS logits, forward or backward.
DIRECT_MAX_ELEMENTS = 1 << 22
CHUNK_ELEMENTS = 1 << 22


def token_logprobs(logits_BTV: Tensor, labels_BT: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[label] per position, >= float32: [B, T, V], [B, T] ->
    [B, T] (the division happens after the cast, so bf16 logits lose nothing more).

    Negative labels (the -100 ignore index) are read as token 0; their values are meaningless
    and must be masked out by the caller. Large or reduced-precision logits go through
    ``chunked_token_logprobs`` (the same values, without a float32 [B, T, V] tensor).
    """
    index_BT = labels_BT.clamp(min=0)
    if logits_BTV.dtype in (torch.float32, torch.float64) and logits_BTV.numel() <= DIRECT_MAX_ELEMENTS:
        scaled = logits_BTV / temperature if temperature != 1.0 else logits_BTV
        logp_BTV = torch.log_softmax(scaled, dim=-1)
        return logp_BTV.gather(-1, index_BT.unsqueeze(-1)).squeeze(-1)
    return chunked_token_logprobs(logits_BTV, index_BT, temperature=temperature)


def chunked_token_logprobs(logits_BTV: Tensor, labels_BT: Tensor,
                           chunk_elements: int = CHUNK_ELEMENTS, temperature: float = 1.0) -> Tensor:
    """``token_logprobs`` computed a few rows at a time: logit[label] - logsumexp(logits), each
    chunk cast to >= float32 on its own, and a backward that recomputes the softmax per chunk
    (d/dlogits = grad x (onehot(label) - softmax)) instead of keeping float32 [B, T, V]
    activations. Labels must be valid indices. [B, T, V], [B, T] -> [B, T]."""
    B, T, V = logits_BTV.shape
    rows = max(1, chunk_elements // max(1, V))
    out_N = _SelectedLogprob.apply(logits_BTV.reshape(B * T, V), labels_BT.reshape(B * T), rows,
                                   float(temperature))
    return out_N.view(B, T)


class _SelectedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_NV: Tensor, labels_N: Tensor, rows: int, temp: float) -> Tensor:
        N = logits_NV.shape[0]
        acc = torch.promote_types(logits_NV.dtype, torch.float32)
        out_N = torch.empty(N, dtype=acc, device=logits_NV.device)
        lse_N = torch.empty(N, dtype=acc, device=logits_NV.device)
        for s in range(0, N, rows):
            x = at_least_float32(logits_NV[s:s + rows]) / temp
            lse = torch.logsumexp(x, dim=-1)
            lse_N[s:s + rows] = lse
            out_N[s:s + rows] = x.gather(-1, labels_N[s:s + rows, None]).squeeze(-1) - lse
        ctx.save_for_backward(logits_NV, labels_N, lse_N)
        ctx.rows, ctx.temp = rows, temp
        return out_N

    @staticmethod
    def backward(ctx: Any, grad_N: Tensor) -> tuple[Tensor | None, None, None, None]:
        logits_NV, labels_N, lse_N = ctx.saved_tensors
        grad_NV = torch.empty_like(logits_NV)
        rows, temp = ctx.rows, ctx.temp
        for s in range(0, logits_NV.shape[0], rows):
            g = grad_N[s:s + rows, None] / temp
            x = at_least_float32(logits_NV[s:s + rows]) / temp
            d = torch.exp(x - lse_N[s:s + rows, None]).mul_(-g)
            d.scatter_add_(-1, labels_N[s:s + rows, None], g)
            grad_NV[s:s + rows] = d
        return grad_NV, None, None, None


def sequence_logprobs(logits_BTV: Tensor, labels_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log p(y | x) = sum_t m_t log p(y_t | y_<t, x): [B, T, V], [B, T], [B, T] -> [B]."""
    return masked_sum(token_logprobs(logits_BTV, labels_BT), mask_BT, dim=1)
