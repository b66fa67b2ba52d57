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
and their completions up to ``SHARED_ROW_TOKENS``), all rows as long as the fullest. Every
padded or repeated position removed is one no layer computes; the price is attention over the
longer row, which for post-training's short sequences is small beside the linear layers (per
token and layer, 4 x 256 x hidden multiply-adds of attention against ~12 x hidden^2 of
projections: 15% for SmolLM2's hidden size of 576 at 256 positions). The runner takes whichever
layout computes the fewest positions, the padded batch included (``choose_layout``). Logprobs
come back on the padded batch's shifted grid, so the losses do not know which layout ran.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
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
    each row's fill. The search starts past the rows no item fits in any more."""
    fill: list[int] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    smallest = min(sizes, default=0)
    start = 0  # rows before it hold less than ``smallest`` free positions
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        row = start
        while row < len(fill) and fill[row] + sizes[i] > capacity:
            row += 1
        if row == len(fill):
            fill.append(0)
        where[i] = (row, fill[row])
        fill[row] += sizes[i]
        while start < len(fill) and fill[start] + smallest > capacity:
            start += 1
    return where, fill


@attrs.frozen
class _Plan:
    """Where a layout puts each sequence, before any tensor is made: ``units[u] = (prompt
    length, sequences)`` (a unit without a shared prompt has length 0 and one sequence), at
    ``where[u] = (row, offset)``; ``fill[r]`` positions of row r hold tokens."""

    units: list[tuple[int, list[int]]]
    where: list[tuple[int, int]]
    fill: list[int]
    lengths: list[int]
    shared: bool

    @property
    def positions(self) -> int:
        return max(1, len(self.fill)) * max(self.fill, default=1)


def _lengths(batch: PolicyBatch) -> list[int]:
    return [int(n) for n in batch.attention_mask_BT.sum(-1).tolist()]


def _plan_pack(batch: PolicyBatch, row_tokens: int | None) -> _Plan:
    lengths = _lengths(batch)
    capacity = max(max(lengths), ROW_TOKENS if row_tokens is None else row_tokens)
    where, fill = _first_fit(lengths, capacity)
    return _Plan([(0, [b]) for b in range(len(lengths))], where, fill, lengths, shared=False)


def _plan_share(batch: PolicyBatch, ids_BT: np.ndarray, row_tokens: int | None) -> _Plan:
    lengths = _lengths(batch)
    loss = batch.loss_mask_BT.bool()
    has = loss.any(-1).tolist()
    first = loss.int().argmax(-1).tolist()  # the first loss token (0 for a row without one)
    capacity = max(max(lengths), SHARED_ROW_TOKENS if row_tokens is None else row_tokens)
    groups: dict[bytes, list[int]] = {}
    for b in range(len(lengths)):
        if has[b]:
            key = first[b].to_bytes(4, "little") + ids_BT[b, :first[b]].tobytes()
            groups.setdefault(key, []).append(b)
    units: list[tuple[int, list[int]]] = []
    for members in groups.values():
        p = first[members[0]]
        unit: list[int] = []
        size = p
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
    return _Plan(units, where, fill, lengths, shared=True)


def _tokens(*runs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Runs of tokens, each given as arrays (sequence, its first token, length, row, column),
    laid end to end and spread to one entry per token: (the token's run, its sequence, its
    position in the sequence, its row, its column)."""
    seq, first, size, row, col = (np.concatenate(parts) for parts in zip(*runs, strict=True))
    run = np.repeat(np.arange(len(size), dtype=np.int64), size)
    run_start = np.repeat(np.cumsum(size) - size, size)  # each token's run's first entry
    token = first[run] + np.arange(len(run), dtype=np.int64) - run_start
    return run, seq[run], token, row[run], col[run] + token - first[run]


def _build(batch: PolicyBatch, ids_BT: np.ndarray, plan: _Plan, pad_token_id: int) -> Packed:
    """The tensors of ``plan``, built in numpy from its runs of tokens (a shared prompt, a
    sequence or a completion: where it is read from and where it goes) in a few indexed copies."""
    B, T = ids_BT.shape
    R, C = max(1, len(plan.fill)), max(plan.fill, default=1)
    lengths = plan.lengths
    # Every unit's members in order, their unit, and their tokens after the unit's prompt.
    i64 = np.int64
    counts = np.array([len(members) for _, members in plan.units], dtype=i64)
    prompt = np.array([p for p, _ in plan.units], dtype=i64)
    u_row, u_col = np.array(plan.where, dtype=i64).reshape(-1, 2).T
    mb = np.fromiter((b for _, members in plan.units for b in members), dtype=i64,
                     count=int(counts.sum()))
    mu = np.repeat(np.arange(len(counts), dtype=i64), counts)
    tail = np.asarray(lengths, dtype=i64)[mb] - prompt[mu]
    before = np.cumsum(tail) - tail  # tail tokens of earlier members, earlier units included
    unit_start = np.cumsum(counts) - counts  # each unit's first member
    # Runs of tokens as (sequence, its first token, length, row, column): each member's tail
    # after its unit's prompt; a shared prompt laid once (read from the unit's first member),
    # and placed once per member (where each sequence's prompt tokens are).
    tail_col = u_col[mu] + prompt[mu] + before - before[unit_start][mu]
    tails = (mb, prompt[mu], tail, u_row[mu], tail_col)
    shared = np.flatnonzero(prompt > 0)
    laid_prompts = (mb[unit_start[shared]], np.zeros(len(shared), dtype=i64), prompt[shared],
                    u_row[shared], u_col[shared])
    with_prompt = prompt[mu] > 0
    placed_prompts = (mb[with_prompt], np.zeros(int(with_prompt.sum()), dtype=i64),
                      prompt[mu][with_prompt], u_row[mu][with_prompt], u_col[mu][with_prompt])
    units = np.concatenate([shared, mu])
    member = np.concatenate([np.full(len(shared), -1, dtype=i64), mb])  # -1: a shared prompt
    run, source, token, row, column = _tokens(laid_prompts, tails)
    at = (row, column)
    ids = np.full((R, C), pad_token_id, dtype=np.int64)
    pos = np.zeros((R, C), dtype=np.int64)
    seq = np.full((R, C), -1, dtype=np.int64)
    unit_RC = -1 - np.arange(R * C, dtype=np.int64).reshape(R, C)  # padding: a unit per position
    member_RC = np.full((R, C), -1, dtype=np.int64)
    ids[at] = ids_BT[source, token]
    pos[at] = token
    seq[at] = source
    unit_RC[at] = units[run]
    member_RC[at] = member[run]
    place = np.full((B, T), -1, dtype=np.int64)
    _, seq_of, token, row, column = _tokens(placed_prompts, tails)
    place[seq_of, token] = row * C + column
    if not plan.shared:  # a row's tail: a run of its own, attended by nothing else
        used = np.zeros((R, 1), dtype=i64)
        used[:len(plan.fill), 0] = plan.fill
        beyond = np.arange(C, dtype=i64)[None, :] - used
        pos = np.where(beyond >= 0, beyond, pos)
    device = batch.input_ids_BT.device
    t = {k: torch.from_numpy(v).to(device) for k, v in
         {"ids": ids, "pos": pos, "seq": seq, "place": place}.items()}
    if not plan.shared:
        loss = torch.zeros((R, C), dtype=batch.loss_mask_BT.dtype, device=device)
        flat = t["place"].reshape(-1)
        keep = flat >= 0
        loss.view(-1)[flat[keep]] = batch.loss_mask_BT.reshape(-1)[keep]
        rows = PolicyBatch(t["ids"], torch.ones_like(t["ids"]), t["pos"], loss, t["seq"],
                           packed=True)
        return Packed(rows, t["place"], lengths, sum(lengths), list(plan.where))
    # Who attends whom: same unit, not later, and a completion's own tokens or the prompt.
    unit = torch.from_numpy(unit_RC).to(device)
    member = torch.from_numpy(member_RC).to(device)
    i = torch.arange(C, device=device)
    attention = ((i[None, :] <= i[:, None])[None]
                 & (unit[:, None, :] == unit[:, :, None])
                 & ((member[:, None, :] == -1) | (member[:, None, :] == member[:, :, None])))
    rows = PolicyBatch(t["ids"], torch.ones_like(t["ids"]), t["pos"], torch.zeros_like(t["ids"]),
                       t["seq"], packed=True)
    return Packed(rows, t["place"], lengths, sum(plan.fill), attention=attention[:, None])


def pack(batch: PolicyBatch, pad_token_id: int = 0, row_tokens: int | None = None) -> Packed:
    """Lay the sequences of a right-padded ``batch`` into as few rows of ``row_tokens``
    positions (at least the longest sequence) as they fit. A batch with packer-owned model
    inputs (images, per-token types) or without 1-D positions cannot be packed: ValueError."""
    _refuse_extras(batch)
    return _build(batch, _ids(batch), _plan_pack(batch, row_tokens), pad_token_id)


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
    ids = _ids(batch)
    return _build(batch, ids, _plan_share(batch, ids, row_tokens), pad_token_id)


def _ids(batch: PolicyBatch) -> np.ndarray:
    return batch.input_ids_BT.detach().cpu().numpy()


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
    nothing and pay for the longer rows' attention). Only the chosen layout is built."""
    plan = _choose(batch, mask_kind)
    return None if plan is None else _build(batch, plan[1], plan[0], pad_token_id)


def _choose(batch: PolicyBatch, mask_kind: str | None) -> tuple[_Plan, np.ndarray] | None:
    if batch.segmented:  # split episodes run padded, with their block-diagonal mask
        return None
    _refuse_extras(batch)
    ids = _ids(batch)
    best = _plan_pack(batch, None)
    if mask_kind is not None:
        shared = _plan_share(batch, ids, None)
        if shared.positions < best.positions:
            best = shared
    return (best, ids) if best.positions < batch.input_ids_BT.numel() else None


def padding_metrics(batch: PolicyBatch, pad_free: bool, mask_kind: str | None = None
                    ) -> dict[str, float]:
    """The share of computed positions that hold no token, padded and as the run computes it,
    and the positions computed as a share of the padded batch's."""
    tokens = float(batch.attention_mask_BT.sum())
    padded_positions = batch.attention_mask_BT.numel()
    padded = 1.0 - tokens / padded_positions
    chosen = _choose(batch, mask_kind) if pad_free else None
    if chosen is None:
        return {"batch/padding_share": padded, "batch/padding_share_run": padded,
                "batch/positions_share": 1.0}
    plan = chosen[0]
    return {"batch/padding_share": padded,
            "batch/padding_share_run": 1.0 - sum(plan.fill) / plan.positions,
            "batch/positions_share": plan.positions / padded_positions}


def packed_logprobs(model: Any, batch: PolicyBatch, temperature: float, pad_token_id: int = 0,
                    takes_logits_to_keep: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``batch_logprobs`` of a padded batch computed in the layout of ``choose_layout``:
    (logprobs_BT, mask_BT) on the padded batch's shifted grid [B, T-1], 0 off the loss mask.
    The LM head runs only on the columns some loss token is predicted from. None when no layout
    computes fewer positions than the padded batch: the caller runs it padded."""
    kind = attention_mask_kind(model)
    if (pad_token_id, kind) not in batch.layouts:
        batch.layouts[pad_token_id, kind] = choose_layout(batch, pad_token_id, kind)
    p = batch.layouts[pad_token_id, kind]
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
