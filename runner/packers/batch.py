"""What the policy trains on: one sequence (``RLPolicyInput``), a padded or packed batch of them
(``PolicyBatch``, with the packer's own model inputs in ``ModelExtras``) and ``collate``, which
makes the one from the others. ``runner.packers.base`` re-exports them with the DataPacker
contract that produces them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch


@attrs.frozen
class RLPolicyInput:
    """One sequence for the policy: prompt ids followed by completion ids.

    ``loss_mask[t]`` is 1 where token ``t`` is a completion token the loss is taken on (the
    first ``n_ignore_prefix_tokens`` completion tokens are excluded); prompt tokens are 0.
    """

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    n_prompt_tokens: int
    # Packer-owned model inputs, passed on to every forward (policy, reference, critic, teacher):
    # ``extra`` holds per-sequence tensors that collate concatenates along dim 0 (pixel values
    # and grids of its images), ``token_extra`` per-token values (one per input id, e.g.
    # ``mm_token_type_ids``) that collate pads with 0 like the ids.
    extra: dict[str, Any] = attrs.field(factory=dict)
    token_extra: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    # An episode split where its agent rewrote the history (``env.on_rewrite = "split"``): the
    # positions where its later segments begin. Each segment is a sequence of its own: its
    # positions restart at 0 and it attends to itself only (``PolicyBatch.model_kwargs``).
    segments: tuple[int, ...] = ()

    @property
    def completion_ids(self) -> tuple[int, ...]:
        return self.input_ids[self.n_prompt_tokens:]

    def to_plain(self) -> tuple[Any, ...]:
        """Its fields as a plain tuple, to cross ranks (``from_plain`` reads it back)."""
        return (self.input_ids, self.loss_mask, self.n_prompt_tokens, self.extra,
                self.token_extra, self.segments)

    @classmethod
    def from_plain(cls, raw: Sequence[Any]) -> RLPolicyInput:
        return cls(*raw)


@attrs.frozen
class ModelExtras:
    """A batch's packer-owned model inputs: per-token tensors [B, T] (padded like the ids) and
    per-row lists of tensors that the forward concatenates along dim 0 (rows without one are
    skipped; a key no row has is not passed)."""

    token_BT: dict[str, torch.Tensor] = attrs.field(factory=dict)
    rows: dict[str, tuple[torch.Tensor | None, ...]] = attrs.field(factory=dict)

    def select(self, idx: torch.Tensor, width: int) -> ModelExtras:
        rows = [int(i) for i in idx.tolist()]
        return ModelExtras({k: v[idx, :width] for k, v in self.token_BT.items()},
                           {k: tuple(v[i] for i in rows) for k, v in self.rows.items()})

    def to(self, device: torch.device | str) -> ModelExtras:
        return ModelExtras({k: v.to(device) for k, v in self.token_BT.items()},
                           {k: tuple(None if t is None else t.to(device) for t in v)
                            for k, v in self.rows.items()})

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        out = dict(self.token_BT)
        for k, v in self.rows.items():
            present = [t for t in v if t is not None]
            if present:
                out[k] = torch.cat(present, dim=0)
        return out


@attrs.frozen
class PolicyBatch:
    """Right-padded tensors for a batch of B sequences of length at most T.

    With ``packed=True`` the sequences are concatenated into one row (B = 1) and
    ``position_ids`` restart at 0 for each sequence; ``seq_ids_BT`` tells them apart.
    ``position_ids_BT`` is None for a model that computes its own positions (Qwen3-VL's 3-D
    M-RoPE: 1-D positions passed to it would shift its logits). ``extras`` are the packer's own
    model inputs (pixel values, ...), passed on by every forward.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    position_ids_BT: torch.Tensor | None
    loss_mask_BT: torch.Tensor
    seq_ids_BT: torch.Tensor
    packed: bool = False
    extras: ModelExtras = ModelExtras()
    # some row holds several segments (``RLPolicyInput.segments``; ``seq_ids_BT`` tells them
    # apart): its forwards take a block-diagonal causal mask
    segmented: bool = False
    # the padding-free layouts chosen for this very batch (``runner.train.roles.packing``), so
    # a second forward of it (the policy's after the reference's) does not choose again; a
    # batch made from it (``to``, ``select``) starts empty
    layouts: dict[Any, Any] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    def to(self, device: torch.device | str) -> PolicyBatch:
        moved = {f.name: getattr(self, f.name).to(device) for f in attrs.fields(PolicyBatch)
                 if f.init and f.name not in ("packed", "extras", "segmented")
                 and getattr(self, f.name) is not None}
        return attrs.evolve(self, **moved, extras=self.extras.to(device))

    def select(self, idx: torch.Tensor) -> PolicyBatch:
        """Rows ``idx`` of a padded batch, trimmed to their longest sequence."""
        width = int(self.attention_mask_BT[idx].sum(-1).max())
        cut = {name: getattr(self, name)[idx, :width] for name in
               ("input_ids_BT", "attention_mask_BT", "position_ids_BT", "loss_mask_BT",
                "seq_ids_BT") if getattr(self, name) is not None}
        return attrs.evolve(self, **cut, extras=self.extras.select(idx, width))

    def model_kwargs(self, mask_kind: str | None = "bool") -> dict[str, Any]:
        """Keyword arguments of a forward besides ``input_ids``: the attention mask (not when
        packed), the position ids (when the batch has them) and the packer's extras. A
        segmented batch's mask is 4-D, causal within each segment (``segment_mask``), in the
        form the model's attention takes (``mask_kind``: "bool" for SDPA, "additive" for eager;
        ``runner.train.roles.packing.attention_mask_kind``)."""
        kwargs: dict[str, Any] = {} if self.packed else {"attention_mask": self.attention_mask_BT}
        if self.segmented and not self.packed:
            kwargs["attention_mask"] = segment_mask(self, mask_kind)
        if self.position_ids_BT is not None:
            kwargs["position_ids"] = self.position_ids_BT
        return {**kwargs, **self.extras.model_kwargs()}


def collate(inputs: Sequence[RLPolicyInput], pad_token_id: int, *,
            packed: bool = False) -> PolicyBatch:
    if not inputs:
        raise ValueError("cannot collate an empty batch")
    if packed and any(x.extra or x.token_extra for x in inputs):
        raise ValueError("padding-free packing cannot carry a packer's extra model inputs "
                         "(pixel values, mm_token_type_ids): collate these sequences padded")
    if packed and any(x.segments for x in inputs):
        raise ValueError("an episode split in segments is collated padded (its rows take a "
                         "block-diagonal mask)")
    if packed:
        ids = [t for x in inputs for t in x.input_ids]
        loss = [m for x in inputs for m in x.loss_mask]
        pos = [p for x in inputs for p in range(len(x.input_ids))]
        seq = [i for i, x in enumerate(inputs) for _ in x.input_ids]
        as_row = lambda v: torch.tensor([v], dtype=torch.long)  # noqa: E731
        return PolicyBatch(as_row(ids), torch.ones(1, len(ids), dtype=torch.long), as_row(pos),
                           as_row(loss), as_row(seq), packed=True)
    width = max(len(x.input_ids) for x in inputs)
    B = len(inputs)
    # one tensor per field from padded lists (a write per row costs more on short rows)
    input_ids = torch.tensor([[*x.input_ids, *[pad_token_id] * (width - len(x.input_ids))]
                              for x in inputs], dtype=torch.long)
    loss_mask = torch.tensor([[*x.loss_mask, *[0] * (width - len(x.loss_mask))]
                              for x in inputs], dtype=torch.long)
    lengths = torch.tensor([len(x.input_ids) for x in inputs], dtype=torch.long)
    real = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    attention = real.long()
    seq_ids = torch.where(real, torch.arange(B).unsqueeze(1), -1)
    later = B  # the ids of later segments: after every row's own
    for b, x in enumerate(inputs):
        n = len(x.input_ids)
        for start in x.segments:  # each later segment: an id of its own
            seq_ids[b, start:n] = later
            later += 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    for b, x in enumerate(inputs):
        for start in x.segments:  # positions from 0 again in each later segment
            position_ids[b, start:] -= int(position_ids[b, start])
    position_ids.clamp_(min=0)
    return PolicyBatch(input_ids, attention, position_ids, loss_mask, seq_ids,
                       extras=collate_extras(inputs, width),
                       segmented=any(x.segments for x in inputs))


def segment_mask(batch: PolicyBatch, mask_kind: str | None) -> torch.Tensor:
    """The [B, 1, T, T] attention mask of a segmented padded batch: a position attends to the
    earlier positions of its own segment (``seq_ids_BT``) that hold a token; a padding
    position to itself only (a query that attends to nothing would make its output NaN).
    Boolean (True: attend) for ``mask_kind = "bool"``, else additive (0 or the dtype's
    minimum)."""
    if mask_kind is None:
        raise ValueError("an episode split in segments (env.on_rewrite = 'split') needs an "
                         "attention implementation that takes a custom mask (sdpa or eager), "
                         "not flash attention")
    seq, real = batch.seq_ids_BT, batch.attention_mask_BT.bool()
    T = seq.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seq.device).tril()
    allowed = causal & (seq[:, :, None] == seq[:, None, :]) & real[:, None, :]
    allowed |= torch.eye(T, dtype=torch.bool, device=seq.device)
    allowed = allowed[:, None]
    if mask_kind == "bool":
        return allowed
    return torch.zeros(allowed.shape, device=seq.device).masked_fill_(
        ~allowed, torch.finfo(torch.float32).min)


def collate_extras(inputs: Sequence[RLPolicyInput], width: int) -> ModelExtras:
    """The packer-owned inputs of a padded batch: ``token_extra`` right-padded with 0 to
    ``width``, ``extra`` kept per row (None where a row has none)."""
    token_keys = sorted({k for x in inputs for k in x.token_extra})
    row_keys = sorted({k for x in inputs for k in x.extra})
    token_BT = {}
    for k in token_keys:
        grid = torch.zeros((len(inputs), width), dtype=torch.long)
        for b, x in enumerate(inputs):
            values = x.token_extra.get(k)
            if values is not None:
                if len(values) != len(x.input_ids):
                    raise ValueError(f"token_extra[{k!r}] has {len(values)} values for "
                                     f"{len(x.input_ids)} input ids")
                grid[b, :len(values)] = torch.tensor(values, dtype=torch.long)
        token_BT[k] = grid
    rows = {k: tuple(x.extra.get(k) for x in inputs) for k in row_keys}
    return ModelExtras(token_BT, rows)
