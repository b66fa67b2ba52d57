"""SFT's spec: given conversations, their assistant tokens trained by NLL; no reference, no
sampling while it trains (an engine only generates for the held-out set)."""

from __future__ import annotations

from runner.errors import Problem
from runner.recipe.algos.spec import AlgoSpec, Shape
from runner.recipe.held_out import held_out_reason
from runner.recipe.rules import in_range
from runner.recipe.rules import is_set as _set
from runner.recipe.schema import Recipe, SFTConfig


def shape(a: SFTConfig) -> Shape:
    return Shape(a.examples_per_step, a.examples_per_step)


def roles(r: Recipe) -> frozenset[str]:
    """A rollout engine and the reward functions only with a held-out set (greedy completions
    of its prompts, scored by the recipe's rewards)."""
    held_out = not held_out_reason(r.data, "conversations")
    return frozenset({"rollout", "reward"} if held_out else set())


def sharded(a: SFTConfig) -> tuple[str, ...]:
    return ("policy",)


def checks(r: Recipe) -> list[Problem]:
    a, d = r.algo, r.data
    p = in_range("algo.examples_per_step", a.examples_per_step, a.examples_per_step >= 1, ">= 1")
    p += in_range("algo.max_seq_len", a.max_seq_len, a.max_seq_len >= 0, ">= 0 (0: no limit)")
    if _set(d.messages_column) and _set(d.response_column):
        p.append(Problem("data.response_column", "a conversation's answers are its assistant "
                         "messages (data.messages_column), not a response column",
                         got=d.response_column, hint="remove data.response_column, or "
                         "data.messages_column for one prompt and one response per row"))
    if (d.factory or d.path or d.name) and not (_set(d.messages_column)
                                                or _set(d.response_column)):
        p.append(Problem("data.messages_column", "SFT trains on answers: name the column of "
                         "whole conversations, or the response column beside the prompt column",
                         hint="set data.messages_column (chat messages), or "
                         "data.response_column (one assistant answer per prompt)"))
    if _set(d.tools_column) and not _set(d.messages_column):
        p.append(Problem("data.tools_column", "tool schemas go with whole conversations "
                         "(data.messages_column), whose tool calls use them",
                         got=d.tools_column, hint="set data.messages_column, or remove "
                         "data.tools_column"))
    if _set(d.messages_column) and not (d.factory or d.path or d.name):
        p.append(Problem("data.messages_column", "the built-in arithmetic data has fixed "
                         "prompt and answer columns", got=d.messages_column,
                         hint="name a source (data.path, data.name or data.factory), or "
                         "remove data.messages_column"))
    return p


SPEC = AlgoSpec(
    title="SFT", config=SFTConfig, stream="conversations", batch_key="algo.examples_per_step",
    shape=shape, roles=roles, checks=checks, loop="runner.train.loops.sft",
    owned_keys=("data.messages_column", "data.tools_column", "data.image_column"),
    samples_online=False,
    sharded=sharded, balances_ranks=True,
)
