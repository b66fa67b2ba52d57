"""The DPO loop (Rafailov et al. 2023): offline preference pairs, a frozen reference, no rollouts.

Each step takes this rank's share of ``pairs_per_step`` pairs from the DatasetPreferenceEnv
cursor, packs chosen and rejected behind one shared prompt encoding, runs them through the
policy in one concatenated forward, and minimises the preference loss (a mean over the global
batch of pairs) against the reference's logprobs (computed per batch, or once for the whole
dataset when ``precompute_reference = true``). Held-out: preference accuracy (implied reward
of chosen > rejected; ties count half) and loss over the full set, each rank its shard.

One step is three plain functions, each with explicit inputs and outputs:

- ``produce``: this rank's share of the step's pairs from the data cursor;
- ``score``: the pairs packed once (chosen and rejected behind one prompt encoding) and the
  reference's summed logprobs of each answer (a ``ScoredPairs``);
- ``consume``: one optimizer step over the global batch of pairs.

DPO samples nothing, so its engine (built only for held-out generation) gets the policy's
weights at evaluations, not after every step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import torch

from runner.algorithms.dpo import DPOLossInputs, dpo_loss
from runner.data.pairs import PreferencePair
from runner.packers.base import DataPacker, PolicyBatch, RLPolicyInput
from runner.ranks.collective import interleave
from runner.recipe.schema import DPOConfig
from runner.rewards import RewardSet
from runner.train.assembly.run import RunContext
from runner.train.loops.balance import balanced_batch_step, balances
from runner.train.loops.batches import (
    lockstep,
    micro_pieces,
    split_even,
    whole_batch_step,
)
from runner.train.loops.held_out import evaluate
from runner.train.loops.loop import run_loop
from runner.train.roles import FrozenScorer
from runner.types import ObsBundle
from runner.ui import Reporter


@attrs.define
class DPORun:
    run: RunContext
    algo: DPOConfig
    reference: FrozenScorer
    rewards: RewardSet | None  # the recipe's reward functions, scoring held-out generations
    cache: dict[str, tuple[float, float]]  # pair id -> reference (chosen, rejected) logprobs

    @property
    def packer(self) -> DataPacker:
        return self.run.policy_packer

    @property
    def device(self) -> Any:
        return self.run.svc.accelerator.device


def sequence_logprobs(role: Any, batch: PolicyBatch) -> torch.Tensor:
    """Summed completion-token logprobs of each sequence of ``batch`` under ``role`` (the
    policy or the reference): [rows]."""
    lp_BT, mask_BT = role.logprobs(batch)
    return (lp_BT * mask_BT).sum(-1)


def completion_tokens(inputs: Sequence[RLPolicyInput], device: Any) -> torch.Tensor:
    """Completion tokens the loss is taken on, per sequence: [len(inputs)]."""
    return torch.tensor([float(sum(x.loss_mask)) for x in inputs], device=device)


def pack_pairs(packer: DataPacker, pairs: Sequence[PreferencePair]) -> list[RLPolicyInput]:
    """[chosen_0 .. chosen_n, rejected_0 .. rejected_n]: one concatenated batch."""
    both = [packer.get_preference_input(ObsBundle(p.prompt, id=p.id), p.chosen, p.rejected)
            for p in pairs]
    return [c for c, _ in both] + [r for _, r in both]


def cached_reference(run: DPORun, pairs: Sequence[Any]
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The precomputed reference logprobs (chosen, rejected) of ``pairs``, or None unless
    every one of them is in the cache."""
    if run.algo.precompute_reference and all(p.id in run.cache for p in pairs):
        values = torch.tensor([run.cache[p.id] for p in pairs], device=run.device)
        return values[:, 0], values[:, 1]
    return None


@torch.no_grad()
def reference_logprobs(run: DPORun, pairs: Sequence[Any], batch: PolicyBatch
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's summed logprobs (chosen, rejected) of ``pairs``, packed in ``batch``:
    from the cache when they are all in it, else from a reference forward."""
    cached = cached_reference(run, pairs)
    if cached is not None:
        return cached
    n = len(pairs)
    lp = sequence_logprobs(run.reference, batch)
    return lp[:n], lp[n:]


def pair_loss_inputs(run: DPORun, model: Any, pairs: Sequence[Any]) -> DPOLossInputs:
    """The loss inputs of ``pairs``: ``model``'s and the reference's summed logprobs of the
    chosen and rejected answers (one collated batch read by both), and the chosen answers'
    token counts."""
    inputs = pack_pairs(run.packer, pairs)
    batch = run.packer.collate(inputs).to(run.device)
    n = len(pairs)
    ref_c, ref_r = reference_logprobs(run, pairs, batch)
    lp = sequence_logprobs(model, batch)
    return DPOLossInputs(policy_chosen_B=lp[:n], policy_rejected_B=lp[n:], ref_chosen_B=ref_c,
                         ref_rejected_B=ref_r,
                         chosen_tokens_B=completion_tokens(inputs[:n], run.device))


def precompute(run: DPORun, reporter: Reporter) -> None:
    """Reference logprobs of every training and held-out pair, once (they never change)."""
    env = run.run.state.data
    pairs = env.training_pairs() + env.validation_pairs()
    reporter.message(f"precomputing reference logprobs for {len(pairs)} pairs")
    chunks = split_even(len(pairs), max(1, len(pairs) // 64))
    # ranks hold unequal held-out shards: a sharded reference forwards as often on each
    with lockstep(run.run.svc.comm, len(chunks), run.packer, run.device, run.reference):
        for chunk in chunks:
            part = pairs[chunk]
            batch = run.packer.collate(pack_pairs(run.packer, part)).to(run.device)
            chosen, rejected = reference_logprobs(run, part, batch)
            run.cache.update({p.id: (float(c), float(r))
                              for p, c, r in zip(part, chosen, rejected, strict=True)})


@attrs.frozen(eq=False)
class ScoredPairs:
    """A step's pairs, packed, with the reference's summed logprobs of each answer: [pairs]."""

    pairs: tuple[PreferencePair, ...]  # this rank's (none when gathered from every rank)
    inputs: tuple[RLPolicyInput, ...]  # [chosen_0 .. chosen_n, rejected_0 .. rejected_n]
    ref_chosen_B: torch.Tensor
    ref_rejected_B: torch.Tensor
    # every pair's inputs collated in their order, on the device, when the reference read them
    # in one forward: the policy's forward of the same pairs reads it too (and its layout)
    whole: PolicyBatch | None = None

    def rows(self, idx: torch.Tensor) -> list[RLPolicyInput]:
        """The packed inputs of pairs ``idx``: their chosen answers, then their rejected ones."""
        n, picked = len(self.inputs) // 2, idx.tolist()
        return [self.inputs[i] for i in picked] + [self.inputs[n + i] for i in picked]

    def collated(self, packer: DataPacker, idx: torch.Tensor, device: Any) -> PolicyBatch:
        """``rows(idx)`` collated on ``device``: ``whole`` when ``idx`` is every pair in order."""
        if self.whole is not None and idx.tolist() == list(range(len(self.inputs) // 2)):
            return self.whole
        return packer.collate(self.rows(idx)).to(device)


def produce(run: DPORun) -> list[PreferencePair]:
    """This rank's share of the step's ``pairs_per_step`` pairs; advances the data cursor."""
    ctx = run.run
    return ctx.state.data.next_batch(run.algo.pairs_per_step // ctx.svc.rank.world_size)


def pair_tokens(inputs: Sequence[RLPolicyInput]) -> list[float]:
    """Each pair's tokens, chosen and rejected sequences together (prompt included in both),
    of packed pairs ``inputs`` ([chosen_0 .. chosen_n, rejected_0 .. rejected_n])."""
    n = len(inputs) // 2
    return [float(len(inputs[i].input_ids) + len(inputs[n + i].input_ids)) for i in range(n)]


def micro_batches(run: DPORun, inputs: Sequence[RLPolicyInput]) -> list[list[int]]:
    """The pairs of each micro-batch ``consume``'s optimizer step splits packed pairs
    ``inputs`` into (``grad_accum_steps``, or packed by ``max_tokens_per_microbatch``)."""
    return micro_pieces(run.run.svc.recipe.train, pair_tokens(inputs))


def reference_pieces(run: DPORun, inputs: Sequence[RLPolicyInput]) -> list[list[int]]:
    """The pairs of each reference forward of packed pairs ``inputs``: packed within
    ``train.logprob_max_tokens_per_microbatch`` when it is set, else the micro-batches the
    policy trains on (``micro_batches``), so both read batches padded alike."""
    return micro_pieces(run.run.svc.recipe.train, pair_tokens(inputs), scoring=True)


def score(run: DPORun, pairs: Sequence[PreferencePair]) -> ScoredPairs:
    """The pairs packed once and the reference's logprobs of their answers
    (``reference_pieces``). Every rank runs as many reference forwards (a sharded
    reference's are collectives)."""
    inputs = pack_pairs(run.packer, pairs)
    n, chosen, rejected, order = len(pairs), [], [], []
    pieces = reference_pieces(run, inputs)
    forwards = sum(cached_reference(run, [pairs[i] for i in p]) is None for p in pieces)
    whole = None
    with lockstep(run.run.svc.comm, forwards, run.packer, run.device, run.reference):
        for piece in pieces:
            part_pairs = [pairs[i] for i in piece]
            ref = cached_reference(run, part_pairs)
            if ref is None:
                part = [inputs[i] for i in piece] + [inputs[n + i] for i in piece]
                batch = run.packer.collate(part).to(run.device)
                if piece == list(range(n)):
                    whole = batch
                ref = reference_logprobs(run, part_pairs, batch)
            chosen.append(ref[0])
            rejected.append(ref[1])
            order += piece
    back = torch.argsort(torch.tensor(order, dtype=torch.long))  # micro-batch order -> pairs'
    return ScoredPairs(tuple(pairs), tuple(inputs), torch.cat(chosen)[back.to(chosen[0].device)],
                       torch.cat(rejected)[back.to(rejected[0].device)], whole)


def minibatch_loss(run: DPORun, scored: ScoredPairs, idx: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The preference loss of pairs ``idx`` and its metrics."""
    inputs = scored.rows(idx)
    batch = scored.collated(run.packer, idx, run.device)
    n = len(idx)
    lp = sequence_logprobs(run.run.policy, batch)
    return dpo_loss(DPOLossInputs(
        policy_chosen_B=lp[:n], policy_rejected_B=lp[n:], ref_chosen_B=scored.ref_chosen_B[idx],
        ref_rejected_B=scored.ref_rejected_B[idx],
        chosen_tokens_B=completion_tokens(inputs[:n], run.device)), run.algo)


def consume(run: DPORun, scored: ScoredPairs) -> dict[str, float]:
    """One optimizer step over the global batch of pairs (a mean over all of them); the
    reduced metrics and the learning rate. With the ranks balanced by tokens (``balances``)
    each rank trains its share of every rank's pairs (``balanced``)."""
    ctx = run.run
    if balances(ctx.svc.comm, ctx.svc.recipe.train):
        return balanced(run, scored)
    return whole_batch_step(ctx.policy, ctx.svc.comm, ctx.svc.recipe.train,
                            [1.0] * len(scored.pairs), float(run.algo.pairs_per_step),
                            partial(minibatch_loss, run, scored), pair_tokens(scored.inputs))


def balanced(run: DPORun, scored: ScoredPairs) -> dict[str, float]:
    """``consume``'s optimizer step with the ranks balanced by tokens: every rank's pairs cross
    (packed inputs as plain tuples, the reference's logprobs as CPU tensors, bit for bit), and
    each rank trains its share of them (``balanced_batch_step``, a pair's answers together)
    under the mean over every rank's pairs, as unbalanced."""
    ctx = run.run
    mine = ([x.to_plain() for x in scored.inputs], scored.ref_chosen_B.cpu(),
            scored.ref_rejected_B.cpu())
    per_rank = ctx.svc.comm.gather(mine)
    halves = [(rows[:len(rows) // 2], rows[len(rows) // 2:]) for rows, _, _ in per_rank]
    every = ScoredPairs((), tuple(RLPolicyInput.from_plain(x)
                                  for side in (0, 1) for h in halves for x in h[side]),
                        torch.cat([c for _, c, _ in per_rank]).to(run.device),
                        torch.cat([r for _, _, r in per_rank]).to(run.device))
    owners = [rank for rank, (chosen, _) in enumerate(halves) for _ in chosen]
    return balanced_batch_step(ctx.policy, ctx.svc.comm, ctx.svc.recipe.train, owners,
                               [1.0] * len(owners), float(run.algo.pairs_per_step),
                               partial(minibatch_loss, run, every), pair_tokens(every.inputs))


def one_step(run: DPORun, step: int) -> dict[str, Any]:
    """produce -> score -> consume; the step's metrics (``time/update``: the whole step)."""
    ctx = run.run
    t0 = time.perf_counter()
    pairs = produce(run)
    metrics = consume(run, score(run, pairs))
    ids = ({"data/item_ids": interleave(ctx.svc.comm.gather([p.id for p in pairs]))}
           if ctx.svc.recipe.logging.item_ids else {})
    return {**metrics, **ids, "time/update": time.perf_counter() - t0}


@torch.no_grad()
def held_out(run: DPORun) -> dict[str, float]:
    """Preference accuracy and loss over the held-out pairs (each rank its shard, summed)."""
    ctx = run.run
    pairs = ctx.state.data.validation_pairs()
    correct = loss_sum = 0.0
    chunks = split_even(len(pairs), max(1, len(pairs) // 64))
    # Ranks hold unequal held-out shards: the models forward as often on each, in the order
    # pair_loss_inputs calls them (the reference only when it is not cached).
    reference = None if run.algo.precompute_reference else run.reference
    with lockstep(ctx.svc.comm, len(chunks), run.packer, run.device, reference, ctx.policy):
        for chunk in chunks:
            part = pairs[chunk]
            x = pair_loss_inputs(run, ctx.policy, part)
            margin = ((x.policy_chosen_B - x.ref_chosen_B)
                      - (x.policy_rejected_B - x.ref_rejected_B))
            correct += float((margin > 0).sum() + 0.5 * (margin == 0).sum())
            loss_sum += float(dpo_loss(x, run.algo)[0]) * len(part)
    correct, loss_sum, n = ctx.svc.comm.sum([correct, loss_sum, len(pairs)])
    ctx.sync_weights()  # the generation engine gets the policy's weights at evaluations only
    assert run.rewards is not None  # the plan builds them with the held-out set
    return {"eval/preference_accuracy": correct / max(1.0, n), "eval/loss": loss_sum / max(1.0, n),
            **evaluate(ctx, run.rewards)}


def run(ctx: RunContext) -> dict[str, Any]:
    algo = ctx.svc.recipe.algo
    assert isinstance(algo, DPOConfig)
    assert ctx.roles.reference is not None
    dpo = DPORun(ctx, algo, ctx.roles.reference, ctx.roles.rewards, {})
    if algo.precompute_reference:
        precompute(dpo, ctx.svc.reporter)
    return run_loop(ctx, lambda s: one_step(dpo, s),
                    (lambda: held_out(dpo)) if ctx.state.has_held_out else None)
