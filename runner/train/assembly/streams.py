"""A run's data side, one kind per algorithm: prompts (GRPO, PPO, OPD), preference pairs
(DPO) or conversations (SFT, read from the same sources as prompts). The assembly opens the
sources (checked before any model is built), compares their fingerprint parts with the
checkpoint's cursor, then builds this rank's stream resumed at that cursor, with its shard of
the held-out prompts that evaluation generates from.

Which kind an algorithm uses is its spec's ``stream``; ``open_data`` opens it, so the assembly
has no branch on the kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import numpy as np

from runner.data.conversations import generation_item
from runner.data.cursor import DataCursor, PromptData, PromptStream
from runner.data.order import shard
from runner.data.pairs import PreferencePair
from runner.data.preference import DatasetPreferenceEnv, PreferenceData
from runner.data.sources import PromptSource, build_prompt_sources
from runner.ranks.context import RankContext
from runner.recipe.algos import spec_of
from runner.recipe.schema import Recipe
from runner.types import ObsBundle


@attrs.frozen
class Streamed:
    """This rank's training stream and held-out prompts."""

    data: PromptData | PreferenceData
    held_out_items: list[ObsBundle]  # this rank's shard of the held-out prompts
    has_held_out: bool  # a held-out set exists (each rank evaluates its shard of it)


class OpenedData(Protocol):
    """A run's sources, opened and checked, before any cursor is applied."""

    def fingerprint_parts(self) -> dict[str, str]: ...
    def stream(self, recipe: Recipe, ctx: RankContext, cursor: DataCursor | None) -> Streamed: ...

    def prompts_to_check(self, streamed: Streamed
                         ) -> tuple[list[PromptSource], list[ObsBundle]]:
        """What the engine's prompt-length check reads before the run: the sources whose every
        row's characters it checks, and the held-out items whose tokens it measures."""
        ...


@attrs.frozen
class OpenedPrompts:
    """GRPO's, PPO's and OPD's prompt sources (held-out: None when the recipe has none)."""

    train: PromptSource
    held_out: PromptSource | None

    def fingerprint_parts(self) -> dict[str, str]:
        return self.train.fingerprint_parts()

    def stream(self, recipe: Recipe, ctx: RankContext, cursor: DataCursor | None) -> Streamed:
        """A prompt stream over every rank's global order; this rank's held-out shard."""
        stream = PromptStream(self.train, recipe.run.seed, recipe.data.shuffle, rank=ctx.rank,
                              world=ctx.world_size, cursor=cursor)
        val = self.held_out
        if val is None:
            return Streamed(stream, [], False)
        mine = shard(np.arange(len(val)), ctx.rank, ctx.world_size)
        return Streamed(stream, [val.item(int(i)) for i in mine], True)

    def prompts_to_check(self, streamed: Streamed
                         ) -> tuple[list[PromptSource], list[ObsBundle]]:
        """The training and held-out sources, and every rank's held-out items."""
        val = self.held_out
        sources = [self.train] if val is None else [self.train, val]
        return sources, [val.item(i) for i in range(len(val))] if val is not None else []


@attrs.frozen
class OpenedPairs:
    """DPO's preference environment (it shards and resumes its own pairs)."""

    env: DatasetPreferenceEnv

    def fingerprint_parts(self) -> dict[str, str]:
        return self.env.fingerprint_parts()

    def stream(self, recipe: Recipe, ctx: RankContext, cursor: DataCursor | None) -> Streamed:
        """The environment at ``cursor``. Its held-out pairs are evaluated by preference and,
        as prompts whose reference is the chosen answer, by generation too."""
        env = self.env if cursor is None else self.env.resume_at(cursor)
        held_out = env.validation_pairs()
        return Streamed(env, [pair_item(p) for p in held_out], env.held_out is not None)

    def prompts_to_check(self, streamed: Streamed
                         ) -> tuple[list[PromptSource], list[ObsBundle]]:
        """No prompt source (DPO generates for its held-out pairs only); this rank's held-out
        pairs as prompts."""
        return [], streamed.held_out_items


@attrs.frozen
class OpenedConversations(OpenedPrompts):
    """SFT's conversation sources: a stream over them as over prompts; the held-out
    conversations become the prompts their last assistant message answers
    (``runner.data.conversations.generation_item``), evaluated by NLL and by generation."""

    def stream(self, recipe: Recipe, ctx: RankContext, cursor: DataCursor | None) -> Streamed:
        streamed = super().stream(recipe, ctx, cursor)
        return attrs.evolve(streamed, held_out_items=[
            generation_item(item) for item in streamed.held_out_items])

    def prompts_to_check(self, streamed: Streamed
                         ) -> tuple[list[PromptSource], list[ObsBundle]]:
        """No source's rows are engine prompts; this rank's held-out prompts are."""
        return [], streamed.held_out_items


def open_prompts(recipe: Recipe, ctx: RankContext) -> OpenedPrompts:
    """The training and held-out prompt sources, columns and overlap checked."""
    return OpenedPrompts(*build_prompt_sources(recipe.data, recipe.algo.kind))


def open_pairs(recipe: Recipe, ctx: RankContext) -> OpenedPairs:
    """This rank's preference environment, its sources checked not to overlap."""
    return OpenedPairs(DatasetPreferenceEnv.from_recipe(recipe, rank=ctx.rank,
                                                        world=ctx.world_size))


def open_conversations(recipe: Recipe, ctx: RankContext) -> OpenedConversations:
    """The training and held-out conversation sources, checked as prompt sources are."""
    return OpenedConversations(*build_prompt_sources(recipe.data, recipe.algo.kind))


# the data an algorithm trains on (AlgoSpec.stream) -> how it is opened
_OPENERS: dict[str, Callable[[Recipe, RankContext], OpenedData]] = {
    "prompts": open_prompts,
    "pairs": open_pairs,
    "conversations": open_conversations,
}


def open_data(recipe: Recipe, ctx: RankContext) -> OpenedData:
    """This rank's data for the recipe's algorithm: its prompt sources or preference pairs."""
    return _OPENERS[spec_of(recipe).stream](recipe, ctx)


def pair_item(pair: PreferencePair) -> ObsBundle:
    """A held-out preference pair as a prompt item whose reference is the chosen answer."""
    return ObsBundle(pair.prompt, reference=pair.chosen if isinstance(pair.chosen, str) else "",
                     id=pair.id)
