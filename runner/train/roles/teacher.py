"""The OPD teacher: a frozen model with what it needs to score the student's completions.

``same_tokenizer`` mode scores the student's token ids directly. ``cross_token_multimodal`` mode
lets the teacher have its own tokenizer: a student-codec packer (built from the student's
factory) decodes the completion, the teacher packer re-encodes the prompt and the completion
text, and the teacher's token logprobs are summed onto the student tokens whose character spans
hold them. The assembly builds it (``runner.train.assembly.assemble``); the OPD loop only calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from runner.algorithms.opd import align_to_student
from runner.packers.base import DataPacker, PolicyBatch, RLPolicyInput, collate
from runner.rollout.base import Completion
from runner.train.roles import FrozenScorer
from runner.train.roles.policy import completion_grid

if TYPE_CHECKING:
    from runner.train.loops.trajectory import Trajectory


class Teacher:
    """The frozen teacher. ``student_codec`` and ``packer`` (the teacher's own) are given in
    ``cross_token_multimodal`` mode only."""

    def __init__(self, frozen: FrozenScorer, mode: str, device: Any, pad_token_id: int,
                 student_codec: DataPacker | None = None, packer: DataPacker | None = None
                 ) -> None:
        if (mode == "same_tokenizer") != (student_codec is None and packer is None):
            raise ValueError("the teacher's packers belong to cross_token_multimodal mode only")
        self.frozen = frozen
        self.mode = mode
        self.device = device
        self.pad_token_id = pad_token_id
        self.student_codec = student_codec
        self.packer = packer

    @torch.no_grad()
    def logprobs(self, traj: Trajectory, inputs: Sequence[RLPolicyInput], width: int,
                 temperature: float) -> torch.Tensor:
        """Teacher logprobs of each student completion token, on the student's grid [B, width]."""
        if self.mode == "same_tokenizer":
            batch = collate(inputs, self.pad_token_id).to(self.device)
            return self.frozen.logprobs(batch, temperature)[0][:, :width]
        values = [self._aligned(item, c, temperature)
                  for item, c in zip(traj.items, traj.completions, strict=True)]
        return completion_grid(inputs, values, width).to(self.device)

    @torch.no_grad()
    def logits(self, batch: PolicyBatch, temperature: float, keep_from: int = 0
               ) -> torch.Tensor:
        """Teacher logits over the teacher's whole vocabulary at ``temperature``, on the shifted
        grid's columns ``keep_from ..`` (callers cut a padded one to the student's width for the
        KL)."""
        return self.frozen.logits(batch, keep_from) / temperature

    def _aligned(self, item: Any, completion: Any, temperature: float) -> list[float]:
        """Teacher logprobs (at the sampling temperature, like the student's) of one completion's
        text under the teacher's tokenizer, summed onto the student's tokens."""
        codec, packer = self.student_codec, self.packer
        assert codec is not None and packer is not None
        ids = list(completion.token_ids)
        prefix = [len(codec.decode(ids[:k])) for k in range(len(ids) + 1)]
        student_spans = list(zip(prefix, prefix[1:], strict=False))
        text = codec.decode(ids)
        teacher_ids, teacher_spans = packer.encode_with_offsets(text)
        if completion.finish_reason == "stop":
            teacher_ids.append(packer.eos_token_id)
            teacher_spans.append((len(text), len(text)))
        if not teacher_ids:
            return [0.0] * len(ids)
        # The teacher's packer builds its own input from the item (a multimodal teacher's
        # includes the item's images), followed by the completion in the teacher's tokens.
        x = packer.get_policy_input(item, Completion(tuple(teacher_ids), text, (), "length"))
        lp_BT, mask_BT = self.frozen.logprobs(packer.collate([x]).to(self.device), temperature)
        return align_to_student(student_spans, teacher_spans, lp_BT[mask_BT].tolist())
