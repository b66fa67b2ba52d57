"""DecoderOnlyLLMDataPacker: text prompts through the tokenizer's chat template.

Rollout side: the prompt is rendered with the chat template (``add_generation_prompt=True``) when
the tokenizer has one, else used as plain text; it is encoded without adding special tokens, so a
BOS written by the template is never doubled. Policy side: the prompt ids the engine returned are
reused as they are (never re-tokenised) and the completion ids follow; a completion that stopped
on EOS keeps exactly one EOS, one cut by the length limit gets none.

DPO answer payloads (``get_preference_input``): an answer is text, a chat-message list holding
one assistant message, or a mapping holding its text under exactly one of ``TEXT_FIELDS``
(``{"text": ...}``, a single message ``{"role": "assistant", "content": ...}``, or the
``{"sample": ...}`` payloads of the reference preference format). Any other shape is a
``RecipeError`` naming the pair, the keys found and what to write instead; a model whose answers
carry more than text (images, audio) needs a packer subclass that reads them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from runner.errors import Problem, RecipeError
from runner.packers.base import DataPacker, RLPolicyInput
from runner.packers.chat import with_tool_calls_written
from runner.types import ObsBundle

TEXT_FIELDS = ("text", "content", "sample")


class DecoderOnlyLLMDataPacker(DataPacker):
    """The built-in packer for decoder-only text models (Qwen2, Llama, SmolLM2, ...)."""

    can_pack = True
    renders_chat = True

    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.model_path: str = ""

    def setup(self, model_path: str) -> None:
        from runner.models import load_tokenizer

        self.model_path = str(model_path)
        self.tokenizer = load_tokenizer(model_path,
                                        trust_remote_code=self.model_options.trust_remote_code)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id

    # --- rollout side ---------------------------------------------------------------------
    def get_rollout_input(self, item: ObsBundle) -> str:
        tok = self._tok()
        messages = item.prompt if isinstance(item.prompt, list) else [
            {"role": "user", "content": str(item.prompt)}]
        if tok.chat_template:
            return tok.apply_chat_template(self._for_template(messages),
                                           tools=list(item.tools) or None, tokenize=False,
                                           add_generation_prompt=True)
        text = "\n".join(str(m["content"]) for m in messages)
        bos = tok.bos_token if tok.bos_token and not text.startswith(tok.bos_token) else ""
        return bos + text

    def render_messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                        = None, add_generation_prompt: bool = False) -> list[int]:
        """The chat template's text of ``messages`` (with ``tools``), encoded without adding
        special tokens, as a single-turn prompt is. Assistant ``tool_calls`` go to a template
        that renders them; one that does not mention them gets them written into the content
        in the syntax ``parse_tool_calls`` reads (``chat.with_tool_calls_written``)."""
        tok = self._tok()
        if not tok.chat_template:
            raise RecipeError([Problem("model.path", f"{self.model_path}: the tokenizer has no "
                                       "chat template, which [env] episodes render messages with",
                                       hint="use a chat model, or a DataPacker whose "
                                       "render_messages renders them")])
        text = tok.apply_chat_template(self._for_template(messages), tools=tools or None,
                                       tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
        return self.encode_rollout_input(text)

    def _for_template(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as the template reads them: assistant tool calls written into the
        content when the template does not mention ``tool_calls``."""
        if "tool_calls" in self._tok().chat_template:
            return messages
        return with_tool_calls_written(messages)

    def encode_rollout_input(self, rollout_input: Any) -> list[int]:
        if isinstance(rollout_input, list | tuple):
            return [int(t) for t in rollout_input]
        return plain_encoding(self._tok(), rollout_input)[0]

    # --- policy side ----------------------------------------------------------------------
    def get_policy_input(
        self,
        sample: ObsBundle,
        rollout_output: Any,
        n_ignore_prefix_tokens: int = 0,
        *,
        prompt_ids: Sequence[int] | None = None,
    ) -> RLPolicyInput:
        """``rollout_output`` is a ``Completion`` (token ids + finish reason) or a text answer."""
        if prompt_ids is None:
            prompt_ids = self.encode_rollout_input(self.get_rollout_input(sample))
        completion = self._completion_ids(rollout_output)
        ids = tuple(int(t) for t in prompt_ids) + completion
        n_prompt = len(prompt_ids)
        mask = [0] * n_prompt + [0 if i < n_ignore_prefix_tokens else 1
                                 for i in range(len(completion))]
        return RLPolicyInput(ids, tuple(mask), n_prompt)

    def get_preference_input(self, prompt: ObsBundle, chosen: Any, rejected: Any
                             ) -> tuple[RLPolicyInput, RLPolicyInput]:
        """The (chosen, rejected) sequences of one DPO pair, sharing one prompt encoding.

        Each answer goes through ``answer_text`` (see the module docstring for the accepted
        shapes); ``prompt.id`` names the pair in errors.
        """
        chosen_text = answer_text(chosen, side="chosen", pair=prompt.id, packer=self)
        rejected_text = answer_text(rejected, side="rejected", pair=prompt.id, packer=self)
        prompt_ids = self.encode_rollout_input(self.get_rollout_input(prompt))
        return (self.get_policy_input(prompt, chosen_text, prompt_ids=prompt_ids),
                self.get_policy_input(prompt, rejected_text, prompt_ids=prompt_ids))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok().decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return plain_encoding(self._tok(), text, offsets=True)

    @property
    def eos_token_id(self) -> int:
        return int(self._tok().eos_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self._tok())

    def _completion_ids(self, rollout_output: Any) -> tuple[int, ...]:
        eos = self.eos_token_id
        if isinstance(rollout_output, str):  # a text answer (DPO, SFT-style data): close with EOS
            ids = plain_encoding(self._tok(), rollout_output)[0]
            return tuple(ids if ids and ids[-1] == eos else [*ids, eos])
        ids = [int(t) for t in rollout_output.token_ids]
        while len(ids) >= 2 and ids[-1] == eos and ids[-2] == eos:
            ids.pop()  # never train on a doubled EOS
        if rollout_output.finish_reason == "stop" and (not ids or ids[-1] != eos):
            ids.append(eos)
        return tuple(ids)

    def _tok(self) -> Any:
        if self.tokenizer is None:
            raise RuntimeError(f"{type(self).__name__}.setup(model_path) was not called")
        return self.tokenizer


def plain_encoding(tok: Any, text: str, offsets: bool = False
                   ) -> tuple[list[int], list[tuple[int, int]]]:
    """``text``'s ids without added special tokens (and, with ``offsets``, each token's span
    of characters; else no spans), as ``tok(text, add_special_tokens=False)`` gives them.

    A fast tokenizer whose own call goes straight to its Rust backend (transformers'
    ``TokenizersBackend`` path, not overridden) is asked directly, skipping the call's
    argument handling (about half of the time of a short text), while the backend is set as
    that call would leave it: no truncation, no padding, special tokens read as such unless
    the tokenizer splits them. Any other tokenizer, or a backend set otherwise, takes the call.
    """
    backend = _direct_backend(tok)
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets] if offsets else []
    out = tok(text, add_special_tokens=False, return_offsets_mapping=offsets)
    return (list(out["input_ids"]),
            [(int(a), int(b)) for a, b in out["offset_mapping"]] if offsets else [])


def _direct_backend(tok: Any) -> Any:
    """``tok``'s Rust backend when encoding with it directly equals ``tok``'s own call (see
    ``plain_encoding``), else None."""
    if not _calls_backend_directly(type(tok)):
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != bool(getattr(tok, "split_special_tokens", False))):
        return None
    return backend


@functools.cache
def _calls_backend_directly(cls: type) -> bool:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: always the tokenizer's own call
        return False
    return (issubclass(cls, TokenizersBackend)
            and cls._encode_plus is TokenizersBackend._encode_plus
            and cls.__call__ is PreTrainedTokenizerBase.__call__
            and getattr(cls, "_switch_to_input_mode", None) is None)


def answer_text(payload: Any, *, side: str, pair: str = "", packer: Any = None) -> str:
    """The text of one DPO answer payload, or a RecipeError saying why it is not one.

    >>> answer_text("42", side="chosen")
    '42'
    >>> answer_text({"sample": "preferred-3"}, side="chosen")
    'preferred-3'
    >>> answer_text([{"role": "assistant", "content": "7"}], side="rejected")
    '7'
    """
    if isinstance(payload, str):
        return payload
    if isinstance(payload, list | tuple):
        if (len(payload) == 1 and isinstance(payload[0], Mapping)
                and payload[0].get("role") == "assistant"
                and isinstance(payload[0].get("content"), str)):
            return payload[0]["content"]
        found = [sorted(m) if isinstance(m, Mapping) else type(m).__name__ for m in payload]
        raise _payload_error(side, pair, packer, f"a list of {len(payload)} element(s) "
                             f"({_short(found)})")
    if isinstance(payload, Mapping):
        fields = [k for k in TEXT_FIELDS if k in payload]
        role = payload.get("role", "assistant")
        if len(fields) == 1 and isinstance(payload[fields[0]], str) and role == "assistant":
            return payload[fields[0]]
        raise _payload_error(side, pair, packer,
                             f"a mapping with keys {_short(sorted(map(str, payload)))}")
    raise _payload_error(side, pair, packer, f"a {type(payload).__name__}")


def _payload_error(side: str, pair: str, packer: Any, found: str) -> RecipeError:
    name = type(packer).__name__ if packer is not None else "DecoderOnlyLLMDataPacker"
    where = f"pair {pair}" if pair else "a preference pair"
    fields = ", ".join(repr(f) for f in TEXT_FIELDS)
    return RecipeError([Problem(
        "data_packer.factory",
        f"{where}: the {side} answer is {found}, which {name} cannot turn into text; it reads "
        f"a string, a one-message list [{{'role': 'assistant', 'content': ...}}], or a mapping "
        f"with exactly one of {fields} holding a string",
        hint="write answers in one of those shapes, or set data_packer.factory to a packer "
        "subclass whose get_preference_input reads this shape")])


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
