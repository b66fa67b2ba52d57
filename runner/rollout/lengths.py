"""How long a rollout sequence may be (``rollout.max_model_len``), and the refusal of prompts
that do not fit, each naming its row and column.

The limit is the engine's ``max_model_len``: prompt tokens plus the completion's
``max_new_tokens``. Given in the recipe, it must not exceed the model's own context (its
config's ``max_position_embeddings``). Left at 0 it is derived:

- vllm: ``max_new_tokens`` plus the longest prompt's tokens, rounded up to a multiple of 64 and
  capped at the model's context;
- hf: the model's context (nothing in the hf engine is sized by the limit).

Every training and held-out prompt is measured (as the packer renders it) before the run
starts when the prompts are text and at most ``MEASURED_PROMPTS`` of them; otherwise a vllm
limit is the model's context too.

Each prompt is checked twice before an engine sees it: by its length in characters *before*
it is rendered and tokenised (a 50 MB prompt must never reach a tokenizer), against the prompt's
token budget times the most characters one token of the vocabulary spells (so a prompt over it
cannot fit), and by its token count after. Sources that read whole columns (files, hub
datasets) have every row's character length checked before anything else; the rest are
checked when measured, or else when drawn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from runner.data.prompt_text import prompt_chars
from runner.errors import Problem, RecipeError
from runner.recipe.rules import env_enabled
from runner.types import ObsBundle

ROUND_TO = 64  # a derived max_model_len is rounded up to a multiple of this
MEASURED_PROMPTS = 100_000  # more prompts than this are not measured up front
_FIX = "shorten or drop the row, or reshape rows with data.items_fn"


def model_context(model_path: str | Path) -> int | None:
    """The model's own context length (``max_position_embeddings`` of its config.json, under
    ``text_config`` for a vision-language model); None when the config names none."""
    from runner.models import text_config_value

    value = text_config_value(model_path, "max_position_embeddings")
    return int(value) if value else None


def chars_per_token(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` spells: the longest entry of its
    vocabulary (byte-level and SentencePiece entries hold at least one character per character
    of text they stand for). 1 for a tokenizer without a vocabulary to read."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else {}
    return max((len(entry) for entry in vocab), default=1) or 1


@attrs.frozen
class PromptLimit:
    """``max_model_len`` (None: no limit known) and how it was set, for the messages."""

    max_model_len: int | None
    why: str  # e.g. "rollout.max_model_len", "the model's context"
    chars_per_token: int = 1

    def _budget(self, max_new_tokens: int) -> int:
        assert self.max_model_len is not None
        return self.max_model_len - max_new_tokens

    def _limit_text(self, max_new_tokens: int) -> str:
        return (f"max_model_len {self.max_model_len:,} ({self.why}) less "
                f"{max_new_tokens:,} new tokens")

    def check_chars(self, chars: int, max_new_tokens: int, where: str, column: str) -> None:
        """Refuse a prompt of ``chars`` characters that cannot fit, before it is tokenised."""
        if self.max_model_len is None:
            return
        budget = self._budget(max_new_tokens)
        limit = budget * self.chars_per_token
        if chars > limit:
            raise _refusal(where, column, f"is {chars:,} characters long, more than the "
                           f"{limit:,} that {budget:,} tokens can spell ({self.chars_per_token} "
                           f"characters per token at most; {self._limit_text(max_new_tokens)}); "
                           "it is refused before tokenising", self.why)

    def check_tokens(self, tokens: int, max_new_tokens: int, where: str, column: str) -> None:
        """Refuse a prompt of ``tokens`` tokens that leaves no room for the completion."""
        if self.max_model_len is None:
            return
        budget = self._budget(max_new_tokens)
        if tokens > budget:
            raise _refusal(where, column, f"is {tokens:,} tokens long, more than the {budget:,} "
                           f"a prompt may have ({self._limit_text(max_new_tokens)})", self.why)

    def check_item(self, item: ObsBundle, max_new_tokens: int) -> None:
        where, column = item.origin.where, item.origin.prompt_column
        self.check_chars(prompt_chars(item.prompt), max_new_tokens, where, column)


def _refusal(where: str, column: str, what: str, why: str) -> RecipeError:
    subject = f"column {column!r}" if column else "the prompt"
    raise_hint = ("raise rollout.max_model_len" if why.startswith("rollout.max_model_len")
                  else "use a model with a longer context")
    return RecipeError([Problem("data.prompt_column" if column else "rollout.max_model_len",
                                f"{where + ': ' if where else ''}{subject} {what}",
                                hint=f"{_FIX}; or {raise_hint}")])


def generated_tokens(recipe: Any) -> int:
    """The most tokens any generation of the run asks for (training or held-out)."""
    return max(recipe.rollout.max_new_tokens, recipe.eval.max_new_tokens)


def stated_limit(recipe: Any, model_path: str | Path) -> PromptLimit:
    """The limit without measuring prompts: ``rollout.max_model_len`` when set (refused when
    the model's context is shorter, or when it leaves no room for the completion), else the
    model's context."""
    context = model_context(model_path)
    given = recipe.rollout.max_model_len
    if not given:
        return PromptLimit(context, "the model's context")
    if context is not None and given > context:
        raise RecipeError([Problem(
            "rollout.max_model_len", f"is longer than the model's context ({context:,}, "
            "max_position_embeddings of its config.json)", got=given,
            hint=f"set at most {context}, or 0 to derive it")])
    return PromptLimit(given, "rollout.max_model_len")


def derived_limit(recipe: Any, model_path: str | Path, tokens: Iterable[int]) -> PromptLimit:
    """``max_new_tokens`` plus the longest of ``tokens`` (the prompts' token counts), or with
    ``[env]`` the episodes' ``max_total_tokens``, rounded up to ``ROUND_TO`` and capped at the
    model's context."""
    context = model_context(model_path)
    longest = max(tokens, default=0)
    episodes = env_enabled(recipe)
    # An episode's every engine call fits in env.max_total_tokens (the turns are cut to it).
    need = recipe.env.max_total_tokens if episodes else generated_tokens(recipe) + longest
    wanted = -(-need // ROUND_TO) * ROUND_TO
    if context is not None and wanted > context:
        return PromptLimit(context, "the model's context")
    if episodes:
        return PromptLimit(wanted, "rollout.max_model_len derived from env.max_total_tokens")
    return PromptLimit(wanted, f"rollout.max_model_len derived from the longest prompt, "
                       f"{longest:,} tokens")


def run_limit(recipe: Any, model_path: str | Path, packer: Any, tokenizer: Any,
              sources: Sequence[Any], held_out: Sequence[ObsBundle], *, measure: bool = True
              ) -> PromptLimit:
    """The run's limit, once every prompt that can be checked before the run is: the characters
    of every row of whole-column ``sources`` (the training, then the held-out
    ``PromptSource``); with ``measure``, the tokens of every training prompt and of
    ``held_out`` (the held-out items) as ``packer`` renders them, when they are text and at
    most ``MEASURED_PROMPTS``. A prompt that does not fit is a RecipeError naming its row. A
    vllm limit left at 0 is derived from the measured prompts (the model's context when none
    were measured); ``measure`` is off where the engine is sized elsewhere (a Ray actor)."""
    codec = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    limit = attrs.evolve(stated_limit(recipe, model_path), chars_per_token=chars_per_token(codec))
    train_new = recipe.rollout.max_new_tokens
    eval_new = recipe.eval.max_new_tokens or train_new
    for n, source in enumerate(sources):
        max_new = train_new if n == 0 else eval_new
        for row, chars in source.prompt_lengths():
            limit.check_chars(chars, max_new, f"row {row} of {source.label}",
                              source.columns.prompt)
    tokens = _measure(limit, packer, sources[0] if sources else None, held_out,
                      train_new, eval_new) if measure else None
    if tokens is None or recipe.rollout.engine != "vllm" or recipe.rollout.max_model_len:
        return limit
    return attrs.evolve(derived_limit(recipe, model_path, tokens),
                        chars_per_token=limit.chars_per_token)


def _measure(limit: PromptLimit, packer: Any, train: Any, held_out: Sequence[ObsBundle],
             train_new: int, eval_new: int) -> list[int] | None:
    """The token count of every training and held-out prompt, each checked against ``limit``;
    None (nothing measured) for more than ``MEASURED_PROMPTS`` or prompts with media (their
    rendering decodes images and videos)."""
    count = (len(train) if train is not None else 0) + len(held_out)
    if count > MEASURED_PROMPTS or (train is not None and (train.columns.image
                                                           or train.columns.video)):
        return None
    items = [(train.item(i), train_new) for i in range(len(train))] if train is not None else []
    items += [(item, eval_new) for item in held_out]
    if any(item.images or item.videos for item, _ in items):
        return None
    tokens = []
    for item, max_new in items:
        limit.check_item(item, max_new)
        n = len(packer.engine_prompt(packer.get_rollout_input(item)).full_ids)
        limit.check_tokens(n, max_new, item.origin.where, item.origin.prompt_column)
        tokens.append(n)
    return tokens
