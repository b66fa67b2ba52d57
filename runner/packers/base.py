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

from runner.errors import Problem, RecipeError
from runner.packers.chat import (
    ToolCall,
    parse_hermes_tool_calls,
    render_conversation,
    template_delta,
)
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


@attrs.frozen
class EnginePrompt:
    """What a rollout engine generates from, made by the packer from its rollout input.

    ``token_ids``: the prompt's ids as a vLLM engine takes them; for a multimodal prompt these
    hold each image or video placeholder once, unexpanded (vLLM runs the model's processor on
    ``multi_modal_data`` and expands them itself). ``expanded_ids``: the processor's ids, with
    every placeholder repeated once per vision token ((): the same as ``token_ids``); the hf
    engine and the policy read these, with ``hf_inputs`` (the processor's tensors that batch
    by concatenation along dim 0: ``pixel_values``, ``image_grid_thw``, ...) and
    ``hf_token_inputs`` (one value per expanded id: ``mm_token_type_ids``; padded with 0).
    """

    token_ids: tuple[int, ...]
    expanded_ids: tuple[int, ...] = ()
    hf_inputs: dict[str, Any] = attrs.field(factory=dict)
    hf_token_inputs: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    multi_modal_data: dict[str, Any] = attrs.field(factory=dict)
    mm_processor_kwargs: dict[str, Any] = attrs.field(factory=dict)

    @property
    def full_ids(self) -> tuple[int, ...]:
        return self.expanded_ids or self.token_ids


def as_engine_prompt(prompt: Any) -> EnginePrompt:
    """An ``EnginePrompt`` as it is; token ids as a text-only one."""
    return (prompt if isinstance(prompt, EnginePrompt)
            else EnginePrompt(tuple(int(t) for t in prompt)))


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
    # Whether ``render_messages`` renders a conversation as the model sees it, so [env] episodes
    # can be played (a packer whose prompts carry media renders more than messages).
    renders_chat: bool = False

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
        """Token ids of a rollout input, exactly as the model sees them (a multimodal packer:
        the processor's ids, every image placeholder expanded)."""

    def engine_prompt(self, rollout_input: Any) -> EnginePrompt:
        """What the rollout engine receives for ``rollout_input``: its token ids, and for a
        multimodal packer its media (see ``EnginePrompt``)."""
        if isinstance(rollout_input, EnginePrompt):
            return rollout_input
        return EnginePrompt(tuple(self.encode_rollout_input(rollout_input)))

    def describe_rollout_input(self, rollout_input: Any) -> list[tuple[str, str]]:
        """(label, value) rows that show a packed rollout input (``--dry-run``)."""
        ids = self.encode_rollout_input(rollout_input)
        return [("rollout input", repr(rollout_input)),
                ("prompt tokens", f"{len(ids)}: {ids[:24]}" + (" ..." if len(ids) > 24 else ""))]

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

    # --- multi-turn episodes ([env]) -------------------------------------------------------
    def render_messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                        = None, add_generation_prompt: bool = False) -> list[int]:
        """Token ids of chat ``messages`` (and ``tools``' schemas) as the model's chat template
        renders them: an episode's prompt, and the base of ``env_message_ids``. A packer that
        cannot render chat cannot play episodes."""
        raise NotImplementedError(f"{type(self).__name__} does not render chat messages "
                                  "(render_messages), which [env] episodes need")

    def env_message_ids(self, conversation: list[dict[str, Any]],
                        new_messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The ids that follow the assistant's generated turn (the last message of
        ``conversation``, which ended on the eos token) when the environment's ``new_messages``
        are appended and the model is prompted again. By default the chat template's own
        rendering, checked to be append-only (``runner.packers.chat``); a model whose template
        is not can override this with a renderer of its own."""
        return template_delta(lambda msgs, gen: self.render_messages(msgs, tools, gen),
                              self.eos_token_id, conversation, new_messages)

    def get_conversation_input(self, messages: list[dict[str, Any]], loss_on: str = "assistant",
                               tools: list[dict[str, Any]] | None = None,
                               images: Sequence[Any] = ()) -> RLPolicyInput:
        """SFT: a whole conversation as one sequence, its loss mask on the tokens the template
        renders for the assistant's messages (``loss_on``), found by rendering it prefix by
        prefix (``runner.packers.chat.render_conversation``: the append-only rule of
        ``env_message_ids``, ``NotAppendOnly`` otherwise). Never searched in decoded text.
        ``images`` (decoded, one per image part of the messages): a text packer takes none."""
        if images:
            raise RecipeError([Problem("data.image_column", f"{type(self).__name__} renders "
                                       "text only: conversations with images need a "
                                       "vision-language model's packer",
                                       hint="use a vision-language model (Qwen3-VL), or remove "
                                       "data.image_column")])
        out = render_conversation(lambda msgs, gen: self.render_messages(msgs, tools, gen),
                                  self.eos_token_id, messages, loss_on)
        first = next((i for i, m in enumerate(out.mask) if m), len(out.mask))
        return RLPolicyInput(tuple(int(t) for t in out.ids), out.mask, first)

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        """The tool calls written in one assistant reply: the Qwen / Hermes syntax
        ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` by default."""
        return parse_hermes_tool_calls(text)

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
