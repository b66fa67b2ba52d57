"""Padding-free training forwards: the sequences of a padded batch laid end to end in as few
rows as fit (first-fit decreasing), position ids restarting at 0 for each sequence so the
model's attention stays within it (transformers builds the block-diagonal mask from the
restarting positions when no attention mask is given).

A row holds ``ROW_TOKENS`` positions (or the longest sequence, if longer). Every padded position
the packing removes is one no layer computes; the price is attention over the longer row, which
for post-training's short sequences is small beside the linear layers (per token and layer,
4 x 128 x hidden multiply-adds of attention against ~12 x hidden^2 of projections: 4% for
SmolLM2's hidden size of 576). Logprobs come back on the padded batch's shifted grid, so the
losses do not know which layout ran.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from runner.algorithms.logprobs import token_logprobs
from runner.packers.base import PolicyBatch


@attrs.frozen
class Packed:
    """A padded batch's sequences in ``rows`` [R, C]; ``where[b] = (row, offset)``."""

    rows: PolicyBatch
    where: list[tuple[int, int]]
    lengths: list[int]

    @property
    def padded_tokens(self) -> int:
        """Positions computed that hold no token of any sequence."""
        R, C = self.rows.input_ids_BT.shape
        return R * C - sum(self.lengths)


ROW_TOKENS = 128


def pack(batch: PolicyBatch, pad_token_id: int = 0, row_tokens: int | None = None) -> Packed:
    """Lay the sequences of a right-padded ``batch`` into as few rows of ``row_tokens``
    positions (at least the longest sequence) as they fit. A batch with packer-owned model
    inputs (images, per-token types) or without 1-D positions cannot be packed: ValueError."""
    if batch.extras.model_kwargs() or batch.position_ids_BT is None:
        raise ValueError("this batch carries model inputs beyond ids and 1-D positions (a "
                         "multimodal packer's); it cannot run padding-free")
    lengths = [int(n) for n in batch.attention_mask_BT.sum(-1).tolist()]
    capacity = max(max(lengths), ROW_TOKENS if row_tokens is None else row_tokens)
    fill: list[int] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for b in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, used in enumerate(fill) if used + lengths[b] <= capacity), len(fill))
        if row == len(fill):
            fill.append(0)
        where[b] = (row, fill[row])
        fill[row] += lengths[b]
    R, C = len(fill), capacity
    device = batch.input_ids_BT.device
    ids = torch.full((R, C), pad_token_id, dtype=torch.long, device=device)
    loss = torch.zeros((R, C), dtype=batch.loss_mask_BT.dtype, device=device)
    seq = torch.full((R, C), -1, dtype=torch.long, device=device)
    pos = torch.zeros((R, C), dtype=torch.long, device=device)
    for b, ((r, o), n) in enumerate(zip(where, lengths, strict=True)):
        ids[r, o:o + n] = batch.input_ids_BT[b, :n]
        loss[r, o:o + n] = batch.loss_mask_BT[b, :n]
        seq[r, o:o + n] = b
        pos[r, o:o + n] = torch.arange(n, device=device)
    for r, used in enumerate(fill):  # the tail: a run of its own, attended by nothing else
        pos[r, used:] = torch.arange(C - used, device=device)
    rows = PolicyBatch(ids, torch.ones_like(ids), pos, loss, seq, packed=True)
    return Packed(rows, where, lengths)


def padding_metrics(batch: PolicyBatch, pad_free: bool) -> dict[str, float]:
    """The share of computed positions that hold no token, padded and as the run computes it."""
    lengths = batch.attention_mask_BT.sum(-1)
    tokens = float(lengths.sum())
    padded = 1.0 - tokens / batch.attention_mask_BT.numel()
    if not pad_free:
        return {"batch/padding_share": padded, "batch/padding_share_run": padded}
    p = pack(batch)
    if not worth_packing(p, batch):
        return {"batch/padding_share": padded, "batch/padding_share_run": padded}
    return {"batch/padding_share": padded,
            "batch/padding_share_run": p.padded_tokens / p.rows.input_ids_BT.numel()}


def worth_packing(p: Packed, batch: PolicyBatch) -> bool:
    """Packing pays only when the packed rows hold fewer positions than the padded batch
    (sequences of nearly one length gain nothing and pay for the longer rows' attention)."""
    return p.rows.input_ids_BT.numel() < batch.input_ids_BT.numel()


def packed_logprobs(model: Any, batch: PolicyBatch, temperature: float, pad_token_id: int = 0,
                    takes_logits_to_keep: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``batch_logprobs`` of a padded batch computed on its packed rows: (logprobs_BT, mask_BT)
    on the padded batch's shifted grid [B, T-1], 0 off the loss mask. The LM head runs only on
    the packed columns some loss token is predicted from. None when packing would compute no
    fewer positions than the padded batch (``worth_packing``): the caller runs it padded."""
    p = pack(batch, pad_token_id)
    if not worth_packing(p, batch):
        return None
    B, T = batch.input_ids_BT.shape
    mask_BT = batch.loss_mask_BT[:, 1:].bool()
    b_idx, t_idx = mask_BT.nonzero(as_tuple=True)
    device = batch.input_ids_BT.device
    if len(b_idx) == 0:
        return torch.zeros(B, T - 1, device=device), mask_BT
    where = torch.tensor(p.where, dtype=torch.long, device=device)
    r_idx = where[b_idx, 0]
    c_idx = where[b_idx, 1] + t_idx  # the packed column that predicts token t + 1 of row b
    cols, k_idx = torch.unique(c_idx, sorted=True, return_inverse=True)
    rows = p.rows
    kwargs: dict[str, Any] = {"use_cache": False, "position_ids": rows.position_ids_BT}
    if takes_logits_to_keep:
        kwargs["logits_to_keep"] = cols
    logits = model(input_ids=rows.input_ids_BT, **kwargs).logits
    if not takes_logits_to_keep:
        logits = logits[:, cols]
    labels = rows.input_ids_BT[:, cols + 1]
    lp_RK = token_logprobs(logits, labels, temperature)
    lp_BT = torch.zeros(B, T - 1, dtype=lp_RK.dtype, device=device)
    lp_BT = lp_BT.index_put((b_idx, t_idx), lp_RK[r_idx, k_idx])
    return lp_BT, mask_BT
