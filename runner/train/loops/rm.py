"""The reward-model loop: Bradley-Terry on given preference pairs, no reference, no engine.

The trained model is the policy's architecture with a scalar score head (``AlgoSpec.head`` is
``"score"``: transformers' ``*ForSequenceClassification``, ``num_labels = 1``), which scores
each prompt + answer at its last token. Each step takes this rank's share of
``pairs_per_step`` pairs from the DatasetPreferenceEnv cursor (DPO's stream: the same sources,
shuffling, sharding and cursor), scores chosen and rejected answers in one concatenated forward
and minimises ``runner.algorithms.rm.rm_loss`` (a mean over the global batch of pairs; each
pair's given margin, ``data.margin_column``, travels with it: 0 without one). Held-out: pair
accuracy (ties count half), loss (with the given margins) and mean score margin over the full
set, each rank its shard.

One step is three plain functions, each with explicit inputs and outputs:

- ``produce``: this rank's share of the step's pairs from the data cursor;
- ``score``: the pairs packed once (chosen and rejected behind one prompt encoding); nothing
  is computed before the update (there is no reference);
- ``consume``: one optimizer step over the global batch of pairs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import torch

from runner.algorithms.rm import rm_loss
from runner.data.pairs import PreferencePair
from runner.packers.base import RLPolicyInput
from runner.ranks.collective import interleave
from runner.recipe.schema import RMConfig
from runner.train.assembly.run import RunContext
from runner.train.loops.balance import balanced_batch_step, balances
from runner.train.loops.batches import (
    lockstep,
    split_even,
    whole_batch_step,
)
from runner.train.loops.dpo import pack_pairs, pair_tokens
from runner.train.loops.loop import run_loop
from runner.train.roles import Trainable


@attrs.define
class RMRun:
    run: RunContext
    algo: RMConfig

    @property
    def device(self) -> Any:
        return self.run.svc.accelerator.device


@attrs.frozen(eq=False)
class PackedPairs:
    """A step's pairs, packed: [chosen_0 .. chosen_n, rejected_0 .. rejected_n], with each
    pair's given margin ([n], float64; 0 without a margin column)."""

    inputs: tuple[RLPolicyInput, ...]
    margins_B: torch.Tensor

    def rows(self, idx: torch.Tensor) -> list[RLPolicyInput]:
        """The packed inputs of pairs ``idx``: their chosen answers, then their rejected ones."""
        n, picked = len(self.inputs) // 2, idx.tolist()
        return [self.inputs[i] for i in picked] + [self.inputs[n + i] for i in picked]

    def margins(self, idx: torch.Tensor) -> torch.Tensor:
        """The given margins of pairs ``idx`` ([len(idx)], float64)."""
        return self.margins_B[idx]


def given_margins(pairs: Sequence[PreferencePair]) -> torch.Tensor:
    """Each pair's given margin (``data.margin_column``; 0 without one), float64."""
    return torch.tensor([p.margin for p in pairs], dtype=torch.float64)


def pair_scores(model: Trainable, run: RMRun, inputs: Sequence[RLPolicyInput]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s scores of packed pairs ``inputs`` (chosen ones, then rejected ones) in one
    forward: (chosen_B, rejected_B)."""
    scores = model.scores(run.run.policy_packer.collate(inputs).to(run.device))
    n = len(inputs) // 2
    return scores[:n], scores[n:]


def produce(run: RMRun) -> list[PreferencePair]:
    """This rank's share of the step's ``pairs_per_step`` pairs; advances the data cursor."""
    ctx = run.run
    return ctx.state.data.next_batch(run.algo.pairs_per_step // ctx.svc.rank.world_size)


def score(run: RMRun, pairs: Sequence[PreferencePair]) -> PackedPairs:
    """The pairs packed once, each answer behind its prompt's encoding."""
    return PackedPairs(tuple(pack_pairs(run.run.policy_packer, pairs)), given_margins(pairs))


def minibatch_loss(run: RMRun, packed: PackedPairs, idx: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The Bradley-Terry loss of pairs ``idx`` (with their given margins) and its metrics."""
    chosen, rejected = pair_scores(run.run.policy, run, packed.rows(idx))
    return rm_loss(chosen, rejected, run.algo.center_coef, packed.margins(idx))


def consume(run: RMRun, packed: PackedPairs) -> dict[str, float]:
    """One optimizer step over the global batch of pairs (a mean over all of them); the
    reduced metrics and the learning rate. A pair counts its chosen and rejected sequences'
    tokens towards ``train.max_tokens_per_microbatch``; with the ranks balanced by tokens
    (``balances``) each rank trains its share of every rank's pairs (``balanced``)."""
    ctx = run.run
    if balances(ctx.svc.comm, ctx.svc.recipe.train):
        return balanced(run, packed)
    return whole_batch_step(ctx.policy, ctx.svc.comm, ctx.svc.recipe.train,
                            [1.0] * (len(packed.inputs) // 2), float(run.algo.pairs_per_step),
                            partial(minibatch_loss, run, packed), pair_tokens(packed.inputs))


def balanced(run: RMRun, packed: PackedPairs) -> dict[str, float]:
    """``consume``'s optimizer step with the ranks balanced by tokens: every rank's pairs cross
    (packed inputs as plain tuples, with their margins), and each rank trains its share of
    them (``balanced_batch_step``, a pair's answers together) under the mean over every rank's
    pairs, as unbalanced."""
    ctx = run.run
    per_rank = ctx.svc.comm.gather(([x.to_plain() for x in packed.inputs], packed.margins_B))
    halves = [(rows[:len(rows) // 2], rows[len(rows) // 2:]) for rows, _ in per_rank]
    every = PackedPairs(tuple(RLPolicyInput.from_plain(x)
                              for side in (0, 1) for h in halves for x in h[side]),
                        torch.cat([m for _, m in per_rank]))
    owners = [rank for rank, (chosen, _) in enumerate(halves) for _ in chosen]
    return balanced_batch_step(ctx.policy, ctx.svc.comm, ctx.svc.recipe.train, owners,
                               [1.0] * len(owners), float(run.algo.pairs_per_step),
                               partial(minibatch_loss, run, every), pair_tokens(every.inputs))


def one_step(run: RMRun, step: int) -> dict[str, Any]:
    """produce -> score -> consume; the step's metrics (``time/update``: the whole step)."""
    ctx = run.run
    t0 = time.perf_counter()
    pairs = produce(run)
    metrics = consume(run, score(run, pairs))
    ids = ({"data/item_ids": interleave(ctx.svc.comm.gather([p.id for p in pairs]))}
           if ctx.svc.recipe.logging.item_ids else {})
    return {**metrics, **ids, "time/update": time.perf_counter() - t0}


@torch.no_grad()
def held_out(run: RMRun) -> dict[str, float]:
    """Pair accuracy (ties count half), loss and mean margin over the held-out pairs (each rank
    its shard, summed)."""
    ctx = run.run
    pairs = ctx.state.data.validation_pairs()
    correct = loss_sum = margin_sum = 0.0
    chunks = split_even(len(pairs), max(1, len(pairs) // 64))
    # Ranks hold unequal held-out shards: the trained model forwards as often on each.
    with lockstep(ctx.svc.comm, len(chunks), ctx.policy_packer, run.device, ctx.policy):
        for chunk in chunks:
            part = pairs[chunk]
            chosen, rejected = pair_scores(ctx.policy, run, pack_pairs(ctx.policy_packer, part))
            _, m = rm_loss(chosen, rejected, run.algo.center_coef, given_margins(part))
            correct += float(m["accuracy"]) * len(part)
            loss_sum += float(m["loss"]) * len(part)
            margin_sum += float(m["margin"]) * len(part)
    correct, loss_sum, margin_sum, n = ctx.svc.comm.sum([correct, loss_sum, margin_sum,
                                                         len(pairs)])
    n = max(1.0, n)
    return {"eval/pair_accuracy": correct / n, "eval/loss": loss_sum / n,
            "eval/margin": margin_sum / n}


def run(ctx: RunContext) -> dict[str, Any]:
    algo = ctx.svc.recipe.algo
    assert isinstance(algo, RMConfig)
    rm = RMRun(ctx, algo)
    return run_loop(ctx, lambda s: one_step(rm, s),
                    (lambda: held_out(rm)) if ctx.state.has_held_out else None)
