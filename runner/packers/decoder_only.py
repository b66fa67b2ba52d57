"""DecoderOnlyLLMDataPacker: text prompts through the tokenizer's chat template.

Rollout side: the prompt is rendered with the chat template (``add_generation_prompt=True``) when
the tokenizer has one, else used as plain text; it is encoded without adding special tokens, so a
BOS written by the template is never doubled. Policy side: the prompt ids the engine returned are
reused as they are (never re-tokenised) and the completion ids follow; a completion that stopped
on EOS keeps exactly one EOS, one cut by the length limit gets none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runner.packers.base import DataPacker, RLPolicyInput
from runner.types import ObsBundle


class DecoderOnlyLLMDataPacker(DataPacker):
    """The built-in packer for decoder-only text models (Qwen2, Llama, SmolLM2, ...)."""

    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.model_path: str = ""

    def setup(self, model_path: str) -> None:
        from runner.models import load_tokenizer

        self.model_path = str(model_path)
        self.tokenizer = load_tokenizer(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id

    # --- rollout side ---------------------------------------------------------------------
    def get_rollout_input(self, item: ObsBundle) -> str:
        tok = self._tok()
        messages = item.prompt if isinstance(item.prompt, list) else [
            {"role": "user", "content": str(item.prompt)}]
        if tok.chat_template:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text = "\n".join(str(m["content"]) for m in messages)
        bos = tok.bos_token if tok.bos_token and not text.startswith(tok.bos_token) else ""
        return bos + text

    def encode_rollout_input(self, rollout_input: Any) -> list[int]:
        if isinstance(rollout_input, list | tuple):
            return [int(t) for t in rollout_input]
        return list(self._tok()(rollout_input, add_special_tokens=False)["input_ids"])

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
        mask = [0] * n_prompt + [0 if i < n_ignore_prefix_tokens else 1 for i in range(len(completion))]
        return RLPolicyInput(ids, tuple(mask), n_prompt)

    def get_preference_input(self, prompt: ObsBundle, chosen: str, rejected: str
                             ) -> tuple[RLPolicyInput, RLPolicyInput]:
        """The (chosen, rejected) sequences of one DPO pair, sharing one prompt encoding."""
        prompt_ids = self.encode_rollout_input(self.get_rollout_input(prompt))
        return (self.get_policy_input(prompt, chosen, prompt_ids=prompt_ids),
                self.get_policy_input(prompt, rejected, prompt_ids=prompt_ids))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok().decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int:
        return int(self._tok().eos_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self._tok())

    def _completion_ids(self, rollout_output: Any) -> tuple[int, ...]:
        eos = self.eos_token_id
        if isinstance(rollout_output, str):  # a text answer (DPO, SFT-style data): close with EOS
            ids = list(self._tok()(rollout_output, add_special_tokens=False)["input_ids"])
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
