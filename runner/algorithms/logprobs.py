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
    if (logits_BTV.dtype in (torch.float32, torch.float64)
            and logits_BTV.numel() <= DIRECT_MAX_ELEMENTS):
        scaled = logits_BTV / temperature if temperature != 1.0 else logits_BTV
        logp_BTV = torch.log_softmax(scaled, dim=-1)
        return logp_BTV.gather(-1, index_BT.unsqueeze(-1)).squeeze(-1)
    return chunked_token_logprobs(logits_BTV, index_BT, temperature=temperature)


def chunked_token_logprobs(logits_BTV: Tensor, labels_BT: Tensor,
                           chunk_elements: int = CHUNK_ELEMENTS,
                           temperature: float = 1.0) -> Tensor:
    """``token_logprobs`` computed a few rows at a time: logit[label] - logsumexp(logits), each
    chunk cast to >= float32 on its own, and a backward that recomputes the softmax per chunk
    (d/dlogits = grad x (onehot(label) - softmax)) instead of keeping float32 [B, T, V]
    activations. Labels must be valid indices. [B, T, V], [B, T] -> [B, T]."""
    B, T, V = logits_BTV.shape
    rows_N = torch.arange(B * T, device=logits_BTV.device)
    out_N = indexed_token_logprobs(logits_BTV.reshape(B * T, V), rows_N, labels_BT.reshape(B * T),
                                   temperature, chunk_elements, direct=False)
    return out_N.view(B, T)


def indexed_token_logprobs(logits_NV: Tensor, rows_M: Tensor, labels_M: Tensor,
                           temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS,
                           direct: bool | None = None) -> Tensor:
    """log softmax(logits_NV[rows_M] / temperature)[labels_M], >= float32: [N, V], [M], [M] ->
    [M]. Several labels may be read from one row (sequences that share a prompt are all
    predicted from its last position); the softmax of a row is computed once however many read
    it. Small float32/64 logits take log_softmax directly; larger or reduced-precision ones the
    chunked form (no float32 copy of more than ``chunk_elements`` logits, forward or backward).
    """
    N, V = logits_NV.shape
    if direct is None:
        direct = logits_NV.dtype in (torch.float32, torch.float64) and N * V <= DIRECT_MAX_ELEMENTS
    if direct:
        scaled = logits_NV / temperature if temperature != 1.0 else logits_NV
        return torch.log_softmax(scaled, dim=-1)[rows_M, labels_M]
    rows = max(1, chunk_elements // max(1, V))
    return _IndexedLogprob.apply(logits_NV, rows_M, labels_M, rows, float(temperature))


class _IndexedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_NV: Tensor, rows_M: Tensor, labels_M: Tensor, rows: int,
                temp: float) -> Tensor:
        N = logits_NV.shape[0]
        acc = torch.promote_types(logits_NV.dtype, torch.float32)
        lse_N = torch.empty(N, dtype=acc, device=logits_NV.device)
        for s in range(0, N, rows):
            lse_N[s:s + rows] = torch.logsumexp(at_least_float32(logits_NV[s:s + rows]) / temp,
                                                dim=-1)
        picked_M = at_least_float32(logits_NV[rows_M, labels_M]) / temp
        ctx.save_for_backward(logits_NV, rows_M, labels_M, lse_N)
        ctx.rows, ctx.temp = rows, temp
        return picked_M - lse_N[rows_M]

    @staticmethod
    def backward(ctx: Any, grad_M: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        logits_NV, rows_M, labels_M, lse_N = ctx.saved_tensors
        rows, temp = ctx.rows, ctx.temp
        g_M = grad_M.to(lse_N.dtype) / temp
        # d/dlogits of sum_m g_m (x[r_m, l_m] - lse[r_m])
        #   = onehot terms - softmax x (sum of g per row)
        g_N = torch.zeros_like(lse_N).index_add_(0, rows_M, g_M)
        order = torch.argsort(rows_M, stable=True)
        rows_sorted = rows_M[order]
        starts = torch.arange(0, logits_NV.shape[0] + rows, rows, device=rows_M.device)
        bounds = torch.searchsorted(rows_sorted, starts).tolist()  # each chunk's labels
        grad_NV = torch.empty_like(logits_NV)
        for i, s in enumerate(range(0, logits_NV.shape[0], rows)):
            x = at_least_float32(logits_NV[s:s + rows]) / temp
            d = torch.exp(x - lse_N[s:s + rows, None]).mul_(-g_N[s:s + rows, None])
            take = order[bounds[i]:bounds[i + 1]]  # the labels read from this chunk's rows
            d.index_put_((rows_M[take] - s, labels_M[take]), g_M[take], accumulate=True)
            grad_NV[s:s + rows] = d  # one rounding to the logits' dtype
        return grad_NV, None, None, None, None


def sequence_logprobs(logits_BTV: Tensor, labels_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log p(y | x) = sum_t m_t log p(y_t | y_<t, x): [B, T, V], [B, T], [B, T] -> [B]."""
    return masked_sum(token_logprobs(logits_BTV, labels_BT), mask_BT, dim=1)
