"""The SFT loop: given conversations, the mean NLL of their assistant tokens; no reference, no
rollouts.

Each step takes this rank's share of ``examples_per_step`` conversations from the data cursor
(the prompt stream's, so shuffling, rank sharding, the fingerprint and resume are the prompts'),
renders each through the packer's chat template prefix by prefix (its loss mask on the tokens
the template renders for the assistant's messages: ``DataPacker.get_conversation_input``, the
append-only rule of ``[env]`` episodes, refused the same way) and takes one optimizer step on
the mean NLL of every trained token of the global batch. A conversation longer than
``algo.max_seq_len`` is refused or, with ``overlong = "drop"``, left out of its step and
counted (``sft/dropped``); it is never cut.

One step is three plain functions, as in the other loops:

- ``produce``: this rank's share of the step's conversations (advances the cursor);
- ``score``: each rendered to its tokens and loss mask (``Examples``), the overlong dropped;
- ``consume``: one optimizer step over the global batch's trained tokens.

Held-out: the NLL per trained token of the held-out conversations and its perplexity, and,
with reward functions, the greedy completions of their prompts (the messages before the last
assistant message) scored against that message's text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import torch

from runner.algorithms.sft import nll_sum, sft_loss
from runner.data.conversations import conversation_of
from runner.data.media import decode_media
from runner.envs.episodes import item_name
from runner.errors import Problem, RecipeError
from runner.packers.base import DataPacker, RLPolicyInput
from runner.packers.chat import NotAppendOnly
from runner.ranks.collective import interleave
from runner.recipe.schema import SFTConfig
from runner.rewards import RewardSet
from runner.train.assembly.run import RunContext
from runner.train.loops.balance import balanced_batch_step, balances
from runner.train.loops.batches import (
    lockstep,
    split_even,
    whole_batch_step,
)
from runner.train.loops.held_out import evaluate
from runner.train.loops.loop import run_loop
from runner.types import ObsBundle

HELD_OUT_CHUNK = 32  # held-out conversations per forward


@attrs.define
class SFTRun:
    run: RunContext
    algo: SFTConfig
    rewards: RewardSet | None  # the recipe's reward functions, scoring held-out generations
    max_len: int  # the most tokens of one conversation (0: no limit)

    @property
    def packer(self) -> DataPacker:
        return self.run.policy_packer

    @property
    def device(self) -> Any:
        return self.run.svc.accelerator.device


@attrs.frozen(eq=False)
class Examples:
    """A step's conversations of this rank, rendered: the kept ones and the dropped ones."""

    items: tuple[ObsBundle, ...]
    inputs: tuple[RLPolicyInput, ...]  # the kept conversations' tokens and loss masks
    dropped: tuple[str, ...]  # how errors name each dropped conversation

    @property
    def tokens(self) -> list[float]:
        """Trained tokens of each kept conversation (its first token is never predicted)."""
        return [float(sum(x.loss_mask[1:])) for x in self.inputs]


def max_len(ctx: RunContext, algo: SFTConfig) -> int:
    """``algo.max_seq_len``, else ``rollout.max_model_len`` (0: no limit)."""
    return algo.max_seq_len or ctx.svc.recipe.rollout.max_model_len


def encode(packer: DataPacker, item: ObsBundle, loss_on: str, model: str) -> RLPolicyInput:
    """The tokens and loss mask of ``item``'s conversation; a template that cannot render it,
    or renders it other than append-only, is a RecipeError naming the item."""
    messages = conversation_of(item)
    images = decode_media(item)[0] if item.images else ()
    try:
        return packer.get_conversation_input(messages, loss_on, list(item.tools) or None,
                                             images)
    except NotAppendOnly as exc:
        raise RecipeError([Problem(
            "model.path", f"{model}: the chat template is not append-only in "
            f"{item_name(item)}: {exc}", hint="SFT masks need a template that renders a longer "
            "conversation as the shorter one's tokens plus new ones; use another model, or a "
            "DataPacker whose get_conversation_input renders it itself")]) from exc
    except RecipeError:
        raise
    except Exception as exc:  # noqa: BLE001 - templates raise what their authors chose
        raise RecipeError([Problem(
            "model.path", f"{model}: the chat template cannot render {item_name(item)}: "
            f"{type(exc).__name__}: {exc}", hint="give its messages roles and fields the "
            "template knows, or use a DataPacker that renders them")]) from exc


def fits(run: SFTRun, item: ObsBundle, x: RLPolicyInput) -> bool:
    """Whether ``x`` is within the length limit; an overlong one is refused unless dropped."""
    if not run.max_len or len(x.input_ids) <= run.max_len:
        return True
    if run.algo.overlong == "drop":
        return False
    key = "algo.max_seq_len" if run.algo.max_seq_len else "rollout.max_model_len"
    raise RecipeError([Problem(key, f"{item_name(item)} renders to {len(x.input_ids)} tokens, "
                               f"more than {run.max_len}", got=run.max_len,
                               hint="raise it, or set algo.overlong = 'drop' to leave such "
                               "conversations out (counted as sft/dropped)")])


def produce(run: SFTRun) -> list[tuple[int, ObsBundle]]:
    """This rank's share of the step's conversations, with their indices; advances the cursor."""
    ctx = run.run
    return ctx.state.data.next_indexed(run.algo.examples_per_step // ctx.svc.rank.world_size)


def score(run: SFTRun, items: Sequence[ObsBundle]) -> Examples:
    """Each conversation rendered to its tokens and loss mask; the overlong ones dropped."""
    model = str(run.run.model_path)
    kept, inputs, dropped = [], [], []
    for item in items:
        x = encode(run.packer, item, run.algo.loss_on, model)
        if fits(run, item, x):
            kept.append(item)
            inputs.append(x)
        else:
            dropped.append(item_name(item))
    return Examples(tuple(kept), tuple(inputs), tuple(dropped))


def rows_loss(run: SFTRun, inputs: Sequence[RLPolicyInput], idx: torch.Tensor
              ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The mean NLL of the trained tokens of rows ``idx`` and its metrics."""
    batch = run.packer.collate([inputs[i] for i in idx.tolist()]).to(run.device)
    return sft_loss(*run.run.policy.logprobs(batch))


def consume(run: SFTRun, ex: Examples) -> dict[str, float]:
    """One optimizer step over the global batch: each micro-batch's mean weighted by its share
    of every rank's trained tokens (``train.max_tokens_per_microbatch`` packs the micro-batches
    by each conversation's tokens). A rank whose conversations were all dropped takes part with
    one zero-weighted row."""
    ctx = run.run
    train = ctx.svc.recipe.train
    inputs, tokens = list(ex.inputs), ex.tokens
    total, kept, dropped = ctx.svc.comm.sum([sum(tokens), len(inputs), len(ex.dropped)])
    if kept and balances(ctx.svc.comm, train):
        stepped = balanced(run, inputs, tokens, max(total, 1.0))
        return {**stepped, "sft/tokens": total, "sft/examples": kept, "sft/dropped": dropped}
    if not inputs:
        pad = run.packer.pad_token_id
        inputs, tokens = [RLPolicyInput((pad, pad), (0, 0), 2)], [0.0]
    stepped = whole_batch_step(ctx.policy, ctx.svc.comm, train, tokens, max(total, 1.0),
                               partial(rows_loss, run, inputs),
                               [float(len(x.input_ids)) for x in inputs])
    return {**stepped, "sft/tokens": total, "sft/examples": kept, "sft/dropped": dropped}


def balanced(run: SFTRun, inputs: Sequence[RLPolicyInput], tokens: Sequence[float],
             total: float) -> dict[str, float]:
    """``consume``'s optimizer step with the ranks balanced by tokens (``balances``): every
    rank's conversations cross as plain tuples, and each rank trains its share of them
    (``balanced_batch_step``); the normaliser is every rank's trained tokens, as unbalanced."""
    ctx = run.run
    mine = [(x.to_plain(), t) for x, t in zip(inputs, tokens, strict=True)]
    per_rank = ctx.svc.comm.gather(mine)
    every = [RLPolicyInput.from_plain(x) for rows in per_rank for x, _ in rows]
    return balanced_batch_step(ctx.policy, ctx.svc.comm, ctx.svc.recipe.train,
                               [r for r, rows in enumerate(per_rank) for _ in rows],
                               [t for rows in per_rank for _, t in rows], total,
                               partial(rows_loss, run, every),
                               [float(len(x.input_ids)) for x in every])


def one_step(run: SFTRun, step: int) -> dict[str, Any]:
    """produce -> score -> consume; the step's metrics (``time/update``: the whole step)."""
    ctx = run.run
    t0 = time.perf_counter()
    indexed = produce(run)
    ex = score(run, [item for _, item in indexed])
    if ex.dropped:
        ctx.svc.reporter.message(f"step {step}: dropped {len(ex.dropped)} conversation(s) over "
                                 f"{run.max_len} tokens ({', '.join(ex.dropped[:3])}"
                                 + (", ...)" if len(ex.dropped) > 3 else ")"))
    metrics = consume(run, ex)
    ids = ({"data/item_ids": interleave(ctx.svc.comm.gather([i for i, _ in indexed]))}
           if ctx.svc.recipe.logging.item_ids else {})
    return {**metrics, **ids, "time/update": time.perf_counter() - t0}


@torch.no_grad()
def held_out_nll(run: SFTRun) -> dict[str, float]:
    """NLL per trained token of the held-out conversations (each rank its shard, summed over
    ranks) and its perplexity; conversations over the length limit are left out and counted
    (``eval/dropped``)."""
    ctx, model = run.run, str(run.run.model_path)
    items = ctx.state.val_items
    inputs, dropped = [], 0
    for item in items:
        conversation = ObsBundle(item.metadata["conversation"], images=item.images, id=item.id,
                                 origin=item.origin, tools=item.tools)
        x = encode(run.packer, conversation, run.algo.loss_on, model)
        if not run.max_len or len(x.input_ids) <= run.max_len:
            inputs.append(x)
        else:
            dropped += 1
    nll = tokens = 0.0
    chunks = split_even(len(inputs), max(1, math.ceil(len(inputs) / HELD_OUT_CHUNK)))
    with lockstep(ctx.svc.comm, len(chunks), run.packer, run.device, ctx.policy):
        for chunk in chunks:
            batch = run.packer.collate(inputs[chunk]).to(run.device)
            part, count = nll_sum(*ctx.policy.logprobs(batch))
            nll, tokens = nll + part, tokens + count
    nll, tokens, dropped = ctx.svc.comm.sum([nll, tokens, dropped])
    mean = nll / max(1.0, tokens)
    return {"eval/nll": mean, "eval/perplexity": math.exp(min(mean, 700.0)),
            "eval/tokens": tokens, "eval/dropped": dropped}


def held_out(run: SFTRun) -> dict[str, float]:
    """The held-out NLL and perplexity; with reward functions, the greedy completions' rewards
    too (the engine gets the policy's weights at evaluations only)."""
    out = held_out_nll(run)
    if run.rewards is not None and run.run.rollout is not None:
        run.run.sync_weights()
        out.update(evaluate(run.run, run.rewards))
    return out


def run(ctx: RunContext) -> dict[str, Any]:
    algo = ctx.svc.recipe.algo
    assert isinstance(algo, SFTConfig)
    sft = SFTRun(ctx, algo, ctx.roles.rewards, max_len(ctx, algo))
    return run_loop(ctx, lambda s: one_step(sft, s),
                    (lambda: held_out(sft)) if ctx.state.has_held_out else None)
