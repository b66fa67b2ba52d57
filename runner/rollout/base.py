"""The RolloutEngine protocol and the values that cross it.

An engine generates ``n`` completions per prompt (prompts are the packer's ``EnginePrompt`` s,
or plain token ids for text),
returns token ids, text, per-token logprobs and finish reasons, takes new weights from the policy
without restarting, and closes. Logprobs are those of the sampling distribution at the given
temperature, before top-p/top-k truncation: ``log_softmax(logits / temperature)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import attrs
import torch

from runner.packers.base import EnginePrompt
from runner.recipe.schema import RolloutConfig, default_of


@attrs.frozen
class SamplingConfig:
    """How one generate call samples; the defaults are the recipe's ``[rollout]`` defaults."""

    n: int = 1
    max_new_tokens: int = default_of(RolloutConfig, "max_new_tokens")
    temperature: float = default_of(RolloutConfig, "temperature")
    top_p: float = default_of(RolloutConfig, "top_p")
    top_k: int = default_of(RolloutConfig, "top_k")  # 0: off
    seed: int = 0
    greedy: bool = False


@attrs.frozen
class Completion:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (ended on EOS, which is the last token) or "length"
    # an agent's episode split where it rewrote the history (env.on_rewrite = "split"): the
    # positions in token_ids where its later segments begin, each with its own prompt
    segments: tuple[int, ...] = ()


@attrs.frozen
class RolloutOutput:
    prompt_ids: tuple[int, ...]
    completions: tuple[Completion, ...]


@runtime_checkable
class RolloutEngine(Protocol):
    name: str
    shared: bool  # one engine serves every rank (a rollout actor): rank 0 alone sends weights

    def generate(self, prompts: Sequence[EnginePrompt | Sequence[int]], sampling: SamplingConfig,
                 seeds: Sequence[int] | None = None) -> list[RolloutOutput]:
        """``len(prompts)`` outputs, each with ``sampling.n`` completions; an output's
        ``prompt_ids`` are its prompt's ``token_ids``.

        ``seeds[i]`` seeds prompt i's samples, so a prompt's completions do not depend on which
        other prompts share the batch (or the rank); without ``seeds`` they derive from
        ``sampling.seed`` and the prompt's index.
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's current weights (Hugging Face parameter names)."""
        ...

    def close(self) -> None: ...


def prompt_seeds(sampling: SamplingConfig, n_prompts: int, seeds: Sequence[int] | None
                 ) -> list[int]:
    """The per-prompt seeds of a generate call (see ``RolloutEngine.generate``)."""
    if seeds is not None:
        if len(seeds) != n_prompts:
            raise ValueError(f"{len(seeds)} seeds for {n_prompts} prompts")
        return [int(s) for s in seeds]
    return [(sampling.seed * 1_000_003 + i) % 2**63 for i in range(n_prompts)]


def trim_at_eos(ids: Sequence[int], eos_token_id: int) -> tuple[list[int], str]:
    """Cut a generated sequence after its first EOS (kept); no EOS means it hit the length limit."""
    ids = list(ids)
    if eos_token_id in ids:
        return ids[: ids.index(eos_token_id) + 1], "stop"
    return ids, "length"
