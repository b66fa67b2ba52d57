"""Padding-free training forwards: the sequences of a padded batch laid end to end in as few
rows as fit (first-fit decreasing), position ids restarting at 0 for each sequence so the
model's attention stays within it (transformers builds the block-diagonal mask from the
restarting positions when no attention mask is given).

Sequences that begin with the same prompt (a GRPO group, the samples of one PPO or OPD prompt,
a DPO pair) can share it: ``share_prompts`` lays each prompt out once, followed by the
completions that continue it, each completion's positions continuing the prompt's, and an
explicit attention mask lets every completion see the prompt and its own earlier tokens only.
Every token's hidden states are those it has in its own padded row, so logprobs and gradients
are the same; the prompt is computed once instead of once per sample.

A row holds up to ``ROW_TOKENS`` positions (or the longest sequence, if longer; shared prompts
and their completions up to ``SHARED_ROW_TOKENS``), all rows as long as the fullest. Every padded or repeated position removed is one
no layer computes; the price is attention over the longer row, which for post-training's short
sequences is small beside the linear layers (per token and layer, 4 x 256 x hidden
multiply-adds of attention against ~12 x hidden^2 of projections: 15% for SmolLM2's hidden
size of 576 at 256 positions). The runner takes whichever layout computes the fewest
positions, the padded batch included (``choose_layout``). Logprobs come back on the padded
batch's shifted grid, so the losses do not know which layout ran.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from runner.algorithms.logprobs import indexed_token_logprobs
from runner.packers.base import PolicyBatch


@attrs.frozen
class Packed:
    """A padded batch's tokens laid out in ``rows`` [R, C].

    ``place_BT[b, t]`` is the flat position (row x C + column) that holds token t of sequence b
    (-1 for padding). ``where[b] = (row, offset)`` when each sequence lies whole in one run of a
    row (``pack``); empty when prompts are shared. ``attention`` is None when the attention
    follows from the restarting positions (block-diagonal), else the boolean [R, 1, C, C] mask
    of which position may attend to which (``share_prompts``). ``filled`` counts the positions
    that hold a token.
    """

    rows: PolicyBatch
    place_BT: torch.Tensor
    lengths: list[int]
    filled: int
    where: list[tuple[int, int]] = attrs.field(factory=list)
    attention: torch.Tensor | None = None

    @property
    def positions(self) -> int:
        return self.rows.input_ids_BT.numel()

    @property
    def padded_tokens(self) -> int:
        """Positions computed that hold no token of any sequence."""
        return self.positions - self.filled


ROW_TOKENS = 128
SHARED_ROW_TOKENS = 256


def _refuse_extras(batch: PolicyBatch) -> None:
    if batch.extras.model_kwargs() or batch.position_ids_BT is None:
        raise ValueError("this batch carries model inputs beyond ids and 1-D positions (a "
                         "multimodal packer's); it cannot run padding-free")


def _first_fit(sizes: list[int], capacity: int) -> tuple[list[tuple[int, int]], list[int]]:
    """First-fit decreasing of ``sizes`` into rows of ``capacity``: (row, offset) per item and
    each row's fill."""
    fill: list[int] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        row = next((r for r, used in enumerate(fill) if used + sizes[i] <= capacity), len(fill))
        if row == len(fill):
            fill.append(0)
        where[i] = (row, fill[row])
        fill[row] += sizes[i]
    return where, fill


def pack(batch: PolicyBatch, pad_token_id: int = 0, row_tokens: int | None = None) -> Packed:
    """Lay the sequences of a right-padded ``batch`` into as few rows of ``row_tokens``
    positions (at least the longest sequence) as they fit. A batch with packer-owned model
    inputs (images, per-token types) or without 1-D positions cannot be packed: ValueError."""
    _refuse_extras(batch)
    lengths = [int(n) for n in batch.attention_mask_BT.sum(-1).tolist()]
    capacity = max(max(lengths), ROW_TOKENS if row_tokens is None else row_tokens)
    where, fill = _first_fit(lengths, capacity)
    R, C = len(fill), max(fill)  # no row longer than the fullest
    B, T = batch.input_ids_BT.shape
    device = batch.input_ids_BT.device
    ids = torch.full((R, C), pad_token_id, dtype=torch.long, device=device)
    loss = torch.zeros((R, C), dtype=batch.loss_mask_BT.dtype, device=device)
    seq = torch.full((R, C), -1, dtype=torch.long, device=device)
    pos = torch.zeros((R, C), dtype=torch.long, device=device)
    place = torch.full((B, T), -1, dtype=torch.long, device=device)
    for b, ((r, o), n) in enumerate(zip(where, lengths, strict=True)):
        ids[r, o:o + n] = batch.input_ids_BT[b, :n]
        loss[r, o:o + n] = batch.loss_mask_BT[b, :n]
        seq[r, o:o + n] = b
        pos[r, o:o + n] = torch.arange(n, device=device)
        place[b, :n] = r * C + o + torch.arange(n, device=device)
    for r, used in enumerate(fill):  # the tail: a run of its own, attended by nothing else
        pos[r, used:] = torch.arange(C - used, device=device)
    rows = PolicyBatch(ids, torch.ones_like(ids), pos, loss, seq, packed=True)
    return Packed(rows, place, lengths, sum(lengths), where)


def share_prompts(batch: PolicyBatch, pad_token_id: int = 0, row_tokens: int | None = None
                  ) -> Packed:
    """Lay out each distinct prompt of ``batch`` once, followed by the completions that continue
    it, in rows of ``row_tokens`` positions (at least the longest sequence).

    A sequence's prompt is its tokens before its first loss token; sequences with the same
    prompt form a group, split into units of one prompt and as many completions as fit in a
    row. A completion's positions continue its prompt's, and it attends to the prompt and to its
    own earlier tokens (``attention``). Sequences without a loss token are left out (nothing of
    theirs is scored). ValueError as ``pack`` for a batch with extra model inputs.
    """
    _refuse_extras(batch)
    B, T = batch.input_ids_BT.shape
    device = batch.input_ids_BT.device
    lengths = [int(n) for n in batch.attention_mask_BT.sum(-1).tolist()]
    loss = batch.loss_mask_BT.bool()
    has = loss.any(-1).tolist()
    first = loss.int().argmax(-1).tolist()  # the first loss token (0 for a row without one)
    capacity = max(max(lengths), SHARED_ROW_TOKENS if row_tokens is None else row_tokens)
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in range(B):
        if has[b]:
            groups.setdefault(tuple(batch.input_ids_BT[b, :first[b]].tolist()), []).append(b)
    units: list[tuple[int, list[int]]] = []  # (prompt length, its sequences)
    for prompt, members in groups.items():
        p, unit, size = len(prompt), [], len(prompt)
        for b in members:
            tail = lengths[b] - p
            if unit and size + tail > capacity:
                units.append((p, unit))
                unit, size = [], p
            unit.append(b)
            size += tail
        units.append((p, unit))
    sizes = [p + sum(lengths[b] - p for b in unit) for p, unit in units]
    where, fill = _first_fit(sizes, capacity)
    R, C = max(1, len(fill)), max(fill, default=1)
    ids = torch.full((R, C), pad_token_id, dtype=torch.long, device=device)
    pos = torch.zeros((R, C), dtype=torch.long, device=device)
    seq = torch.full((R, C), -1, dtype=torch.long, device=device)
    # Who attends whom: same unit, not later, and a completion's own tokens or the prompt.
    # Padding gets a unit of its own per position (it attends to itself only).
    unit_RC = -1 - torch.arange(R * C, device=device).view(R, C)
    member_RC = torch.full((R, C), -1, dtype=torch.long, device=device)
    place = torch.full((B, T), -1, dtype=torch.long, device=device)
    for u, ((p, unit), (r, o)) in enumerate(zip(units, where, strict=True)):
        b0 = unit[0]
        ids[r, o:o + p] = batch.input_ids_BT[b0, :p]
        pos[r, o:o + p] = torch.arange(p, device=device)
        seq[r, o:o + p] = b0
        unit_RC[r, o:o + p] = u
        prompt_place = r * C + o + torch.arange(p, device=device)
        c = o + p
        for b in unit:
            n = lengths[b] - p
            ids[r, c:c + n] = batch.input_ids_BT[b, p:lengths[b]]
            pos[r, c:c + n] = torch.arange(p, lengths[b], device=device)
            seq[r, c:c + n] = b
            unit_RC[r, c:c + n] = u
            member_RC[r, c:c + n] = b
            place[b, :p] = prompt_place
            place[b, p:lengths[b]] = r * C + torch.arange(c, c + n, device=device)
            c += n
    i = torch.arange(C, device=device)
    attention = ((i[None, :] <= i[:, None])[None]
                 & (unit_RC[:, None, :] == unit_RC[:, :, None])
                 & ((member_RC[:, None, :] == -1) | (member_RC[:, None, :] == member_RC[:, :, None])))
    rows = PolicyBatch(ids, torch.ones_like(ids), pos, torch.zeros_like(ids), seq, packed=True)
    return Packed(rows, place, lengths, sum(fill), attention=attention[:, None])


def attention_mask_kind(model: Any) -> str | None:
    """How a custom attention mask is given to ``model``: "bool" (SDPA), "additive" (eager), or
    None when its attention takes none (flash attention: only block-diagonal packing)."""
    inner = getattr(model, "module", model)  # DDP: its module
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    return {"sdpa": "bool", "eager": "additive"}.get(impl)


def choose_layout(batch: PolicyBatch, pad_token_id: int = 0, mask_kind: str | None = None
                  ) -> Packed | None:
    """The layout computing the fewest positions: packed rows, shared prompts (when the model
    takes a custom mask, ``mask_kind``), or None for the padded batch itself (packing pays only
    when it computes fewer positions than the padded batch: sequences of nearly one length gain
    nothing and pay for the longer rows' attention)."""
    best = pack(batch, pad_token_id)
    if mask_kind is not None:
        shared = share_prompts(batch, pad_token_id)
        if shared.positions < best.positions:
            best = shared
    return best if best.positions < batch.input_ids_BT.numel() else None


def padding_metrics(batch: PolicyBatch, pad_free: bool, mask_kind: str | None = None
                    ) -> dict[str, float]:
    """The share of computed positions that hold no token, padded and as the run computes it,
    and the positions computed as a share of the padded batch's."""
    lengths = batch.attention_mask_BT.sum(-1)
    tokens = float(lengths.sum())
    padded = 1.0 - tokens / batch.attention_mask_BT.numel()
    layout = choose_layout(batch, mask_kind=mask_kind) if pad_free else None
    if layout is None:
        return {"batch/padding_share": padded, "batch/padding_share_run": padded,
                "batch/positions_share": 1.0}
    return {"batch/padding_share": padded,
            "batch/padding_share_run": layout.padded_tokens / layout.positions,
            "batch/positions_share": layout.positions / batch.attention_mask_BT.numel()}


def worth_packing(p: Packed, batch: PolicyBatch) -> bool:
    """Whether layout ``p`` computes fewer positions than the padded batch."""
    return p.positions < batch.input_ids_BT.numel()


def packed_logprobs(model: Any, batch: PolicyBatch, temperature: float, pad_token_id: int = 0,
                    takes_logits_to_keep: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``batch_logprobs`` of a padded batch computed in the layout of ``choose_layout``:
    (logprobs_BT, mask_BT) on the padded batch's shifted grid [B, T-1], 0 off the loss mask.
    The LM head runs only on the columns some loss token is predicted from. None when no layout
    computes fewer positions than the padded batch: the caller runs it padded."""
    kind = attention_mask_kind(model)
    p = choose_layout(batch, pad_token_id, kind)
    if p is None:
        return None
    B, T = batch.input_ids_BT.shape
    mask_BT = batch.loss_mask_BT[:, 1:].bool()
    b_idx, t_idx = mask_BT.nonzero(as_tuple=True)
    device = batch.input_ids_BT.device
    if len(b_idx) == 0:
        return torch.zeros(B, T - 1, device=device), mask_BT
    C = p.rows.input_ids_BT.shape[1]
    flat = p.place_BT[b_idx, t_idx]  # the position that predicts token t + 1 of sequence b
    r_idx, c_idx = flat // C, flat % C
    cols, k_idx = torch.unique(c_idx, sorted=True, return_inverse=True)
    rows = p.rows
    kwargs: dict[str, Any] = {"use_cache": False, "position_ids": rows.position_ids_BT}
    if p.attention is not None:
        kwargs["attention_mask"] = (p.attention if kind == "bool" else
                                    torch.zeros(p.attention.shape, device=device).masked_fill_(
                                        ~p.attention, torch.finfo(torch.float32).min))
    if takes_logits_to_keep:
        kwargs["logits_to_keep"] = cols
    logits = model(input_ids=rows.input_ids_BT, **kwargs).logits
    if not takes_logits_to_keep:
        logits = logits[:, cols]
    K, V = logits.shape[1], logits.shape[2]
    labels = batch.input_ids_BT[b_idx, t_idx + 1]
    lp = indexed_token_logprobs(logits.reshape(-1, V), r_idx * K + k_idx, labels, temperature)
    lp_BT = torch.zeros(B, T - 1, dtype=lp.dtype, device=device)
    lp_BT = lp_BT.index_put((b_idx, t_idx), lp)
    return lp_BT, mask_BT
