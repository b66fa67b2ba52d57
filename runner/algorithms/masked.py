"""Reductions over masked tensors, shared by every loss.

Masks are boolean (or 0/1) tensors broadcastable to the values. Masked-off elements are dropped
with ``torch.where``, not multiplied by zero, so an ``inf`` or ``nan`` in a padded position can
reach neither the value nor the gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _where(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.to(torch.bool), x, torch.zeros((), dtype=x.dtype, device=x.device))


def at_least_float32(x: Tensor) -> Tensor:
    """``x`` in float32, or kept in float64: the precision of log-softmax and KL sums."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over the elements where ``mask`` is true: sum_i m_i x_i.

    ``dim=None`` reduces everything to a scalar; otherwise the given dimension only.
    """
    kept = _where(x, mask)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the masked elements: sum_i m_i x_i / max(sum_i m_i, 1).

    A slice with no masked element has mean 0 (never NaN), and its gradient is 0.
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalise ``x`` to zero mean and unit variance over all masked elements.

    out = (x - mu) / sqrt(var + 1e-8), with mu the masked mean and var the unbiased
    (n - 1) masked variance; with ``shift_mean=False`` the mean is added back. Positions
    outside the mask are set to 0. Raises ValueError with fewer than 2 masked elements,
    where the unbiased variance is undefined.
    """
    mask = mask.to(torch.bool).expand_as(x)
    n = int(mask.sum())
    if n < 2:
        raise ValueError(f"masked_whiten needs at least 2 masked elements (got {n}).")
    mean = masked_mean(x, mask)
    var = masked_sum((x - mean) ** 2, mask) / (n - 1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return _where(out, mask)


def metric(x: Tensor) -> Tensor:
    """A loss function's metric: a detached 0-d tensor. The training loop reads it as a float
    once per optimizer step, so computing metrics never waits for the device per micro-batch."""
    return x.detach()
