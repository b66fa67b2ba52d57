"""The DataPacker contract: one object owns a model's rollout-side and policy-side shaping.

A packer turns a canonical item (``ObsBundle``) into what the rollout engine receives
(``get_rollout_input``), turns the engine's output back into what the policy trains on
(``get_policy_input``), and collates policy inputs into padded tensors. Every role that needs the
student's codec builds its own instance from the same factory, then calls ``setup(model_path)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from runner.types import ObsBundle


@attrs.frozen
class RLPolicyInput:
    """One sequence for the policy: prompt ids followed by completion ids.

    ``loss_mask[t]`` is 1 where token ``t`` is a completion token the loss is taken on (the
    first ``n_ignore_prefix_tokens`` completion tokens are excluded); prompt tokens are 0.
    """

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    n_prompt_tokens: int
    extra: dict[str, Any] = attrs.field(factory=dict)  # model-specific inputs (pixel values, ...)

    @property
    def completion_ids(self) -> tuple[int, ...]:
        return self.input_ids[self.n_prompt_tokens:]


@attrs.frozen
class PolicyBatch:
    """Right-padded tensors for a batch of B sequences of length at most T.

    With ``packed=True`` the sequences are concatenated into one row (B = 1) and
    ``position_ids`` restart at 0 for each sequence; ``seq_ids_BT`` tells them apart.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    position_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    seq_ids_BT: torch.Tensor
    packed: bool = False

    def to(self, device: torch.device | str) -> PolicyBatch:
        return attrs.evolve(self, **{f.name: getattr(self, f.name).to(device)
                                     for f in attrs.fields(PolicyBatch) if f.name != "packed"})


@attrs.frozen
class ModelOptions:
    """How the packer's model folder may be loaded: the recipe's ``model.trust_remote_code`` and
    ``model.dtype``. ``build_packer`` sets them on the packer before ``setup`` runs, so a packer
    that loads a tokenizer, a processor or a model loads it as the policy is loaded."""

    trust_remote_code: bool = False
    dtype: str = "float32"


class DataPacker(ABC):
    """Base class of every packer.

    Every method the training loops call is declared here, abstract where no generic version
    exists, so a packer that lacks one fails when it is constructed (in its factory), not at
    step N. Subclassing ``DecoderOnlyLLMDataPacker`` gives working versions of all of them.
    """

    pad_token_id: int = 0
    model_options: ModelOptions = ModelOptions()
    # Whether the policy may run this packer's sequences packed end to end (padding-free): only
    # when the model needs nothing but ids and restarting 1-D positions to tell them apart.
    can_pack: bool = False

    def setup(self, model_path: str) -> None:
        """Load what the packer needs from the model folder (tokenizer, processor).

        ``self.model_options`` says whether remote code may run and in which dtype a model is
        loaded. The base class needs nothing; subclasses override it.
        """
        return None

    # --- rollout side ---------------------------------------------------------------------
    @abstractmethod
    def get_rollout_input(self, item: ObsBundle) -> Any:
        """What the rollout engine receives for ``item`` (a prompt string for text models)."""

    @abstractmethod
    def encode_rollout_input(self, rollout_input: Any) -> list[int]:
        """Token ids of a rollout input, exactly as the engine will see them."""

    # --- policy side ----------------------------------------------------------------------
    @abstractmethod
    def get_policy_input(
        self,
        sample: ObsBundle,
        rollout_output: Any,
        n_ignore_prefix_tokens: int = 0,
        *,
        prompt_ids: Sequence[int] | None = None,
    ) -> RLPolicyInput:
        """What the policy trains on for one completion of ``sample``."""

    @abstractmethod
    def get_preference_input(self, prompt: ObsBundle, chosen: Any, rejected: Any
                             ) -> tuple[RLPolicyInput, RLPolicyInput]:
        """DPO: the (chosen, rejected) sequences of one pair. ``chosen`` and ``rejected`` are the
        source's answer payloads; which shapes are accepted is the packer's to say, and any other
        shape must be a ``RecipeError`` naming the item, not a traceback."""

    def collate(self, inputs: Sequence[RLPolicyInput], *, packed: bool = False) -> PolicyBatch:
        """Pad (or pack) policy inputs into tensors."""
        return collate(inputs, self.pad_token_id, packed=packed)

    # --- codec ----------------------------------------------------------------------------
    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (completions for rewards; the student codec in cross-token OPD)."""

    @abstractmethod
    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of plain ``text`` (no special tokens added) and each token's character
        span in it: cross-token OPD aligns a teacher and a student on these spans."""

    @property
    @abstractmethod
    def eos_token_id(self) -> int:
        """The id that ends a completion."""


def collate(inputs: Sequence[RLPolicyInput], pad_token_id: int, *, packed: bool = False) -> PolicyBatch:
    if not inputs:
        raise ValueError("cannot collate an empty batch")
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
    input_ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((B, width), dtype=torch.long)
    loss_mask = torch.zeros((B, width), dtype=torch.long)
    seq_ids = torch.full((B, width), -1, dtype=torch.long)
    for b, x in enumerate(inputs):
        n = len(x.input_ids)
        input_ids[b, :n] = torch.tensor(x.input_ids, dtype=torch.long)
        attention[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(x.loss_mask, dtype=torch.long)
        seq_ids[b, :n] = b
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return PolicyBatch(input_ids, attention, position_ids, loss_mask, seq_ids)
