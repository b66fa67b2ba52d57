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

from runner.errors import Problem, RecipeError
from runner.packers.batch import ModelExtras, PolicyBatch, RLPolicyInput, collate
from runner.packers.chat import (
    ToolCall,
    parse_hermes_tool_calls,
    render_conversation,
    template_delta,
)
from runner.types import ObsBundle

# the batch types live in runner.packers.batch; importing them from here keeps working
__all__ = ["DataPacker", "EnginePrompt", "ModelExtras", "ModelOptions", "PolicyBatch",
           "RLPolicyInput", "as_engine_prompt", "collate"]


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
