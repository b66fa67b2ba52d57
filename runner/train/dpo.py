"""The DPO loop (Rafailov et al. 2023): offline preference pairs, a frozen reference, no rollouts.

Each step takes this rank's share of ``pairs_per_step`` pairs from the DatasetPreferenceEnv
cursor, packs chosen and rejected behind one shared prompt encoding, runs them through the
policy in one concatenated forward, and minimises the preference loss (a mean over the global
batch of pairs) against the reference's logprobs (computed per batch, or once for the whole
dataset when ``precompute_reference = true``). Held-out: preference accuracy (implied reward
of chosen > rejected; ties count half) and loss over the full set, each rank its shard.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from runner.algorithms.dpo import DPOLossInputs, dpo_loss
from runner.packers.base import PolicyBatch, RLPolicyInput
from runner.ranks.collective import interleave
from runner.recipe.schema import DPOConfig
from runner.rewards import RewardSet
from runner.train.assemble import RunContext
from runner.train.batches import Minibatch, reduce_history, train_minibatch
from runner.train.loop import run_loop
from runner.train.policy import split_even
from runner.train.roles import FrozenScorer
from runner.train.rollouts import evaluate
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
    def packer(self) -> Any:
        return self.run.policy_packer

    @property
    def device(self) -> Any:
        return self.run.accelerator.device


def sequence_logprobs(role: Any, batch: PolicyBatch) -> torch.Tensor:
    """Summed completion-token logprobs of each sequence of ``batch`` under ``role`` (the
    policy or the reference): [rows]."""
    lp_BT, mask_BT = role.logprobs(batch)
    return (lp_BT * mask_BT).sum(-1)


def completion_tokens(inputs: Sequence[RLPolicyInput], device: Any) -> torch.Tensor:
    """Completion tokens the loss is taken on, per sequence: [len(inputs)]."""
    return torch.tensor([float(sum(x.loss_mask)) for x in inputs], device=device)


def _pack(packer: Any, pairs: Sequence[Any]) -> list[RLPolicyInput]:
    """[chosen_0 .. chosen_n, rejected_0 .. rejected_n]: one concatenated batch."""
    both = [packer.get_preference_input(ObsBundle(p.prompt, id=p.id), p.chosen, p.rejected)
            for p in pairs]
    return [c for c, _ in both] + [r for _, r in both]


@torch.no_grad()
def reference_logprobs(run: DPORun, pairs: Sequence[Any], batch: PolicyBatch
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(pairs)
    if run.algo.precompute_reference and all(p.id in run.cache for p in pairs):
        values = torch.tensor([run.cache[p.id] for p in pairs], device=run.device)
        return values[:, 0], values[:, 1]
    lp = sequence_logprobs(run.reference, batch)
    return lp[:n], lp[n:]


def pair_loss_inputs(run: DPORun, model: Any, pairs: Sequence[Any]) -> DPOLossInputs:
    """The loss inputs of ``pairs``: ``model``'s and the reference's summed logprobs of the
    chosen and rejected answers (one collated batch read by both), and the chosen answers'
    token counts."""
    inputs = _pack(run.packer, pairs)
    batch = run.packer.collate(inputs).to(run.device)
    n = len(pairs)
    ref_c, ref_r = reference_logprobs(run, pairs, batch)
    lp = sequence_logprobs(model, batch)
    return DPOLossInputs(policy_chosen_B=lp[:n], policy_rejected_B=lp[n:], ref_chosen_B=ref_c,
                         ref_rejected_B=ref_r, chosen_tokens_B=completion_tokens(inputs[:n], run.device))


def precompute(run: DPORun, reporter: Reporter) -> None:
    """Reference logprobs of every training and held-out pair, once (they never change)."""
    env = run.run.data
    pairs = [env.train.pair(i) for i in range(len(env.train))] + env.validation_pairs()
    reporter.message(f"precomputing reference logprobs for {len(pairs)} pairs")
    for chunk in split_even(len(pairs), max(1, len(pairs) // 64)):
        part = pairs[chunk]
        batch = run.packer.collate(_pack(run.packer, part)).to(run.device)
        chosen, rejected = reference_logprobs(run, part, batch)
        run.cache.update({p.id: (float(c), float(r)) for p, c, r in zip(part, chosen, rejected, strict=True)})


def one_step(run: DPORun, step: int) -> dict[str, Any]:
    ctx, algo = run.run, run.algo
    t0 = time.perf_counter()
    pairs = ctx.data.next_batch(algo.pairs_per_step // ctx.rank.world_size)
    whole = Minibatch(list(range(len(pairs))), [1.0] * len(pairs), float(algo.pairs_per_step))

    def loss_fn(rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return dpo_loss(pair_loss_inputs(run, ctx.policy, [pairs[i] for i in rows.tolist()]), algo)

    history = [train_minibatch([ctx.policy], whole, loss_fn, ctx.recipe.train.grad_accum_steps,
                               ctx.rank.world_size, ctx.recipe.train.max_grad_norm)]
    ctx.policy.scheduler.step()
    ids = ({"data/item_ids": interleave(ctx.comm.gather([p.id for p in pairs]))}
           if ctx.recipe.logging.item_ids else {})
    return {**reduce_history(ctx.comm, history), "lr": ctx.policy.scheduler.get_last_lr()[0], **ids,
            "time/update": time.perf_counter() - t0}


@torch.no_grad()
def held_out(run: DPORun) -> dict[str, float]:
    """Preference accuracy and loss over the held-out pairs (each rank its shard, summed)."""
    ctx = run.run
    pairs = ctx.data.validation_pairs()
    correct = loss_sum = 0.0
    for chunk in split_even(len(pairs), max(1, len(pairs) // 64)):
        part = pairs[chunk]
        x = pair_loss_inputs(run, ctx.policy, part)
        margin = (x.policy_chosen_B - x.ref_chosen_B) - (x.policy_rejected_B - x.ref_rejected_B)
        correct += float((margin > 0).sum() + 0.5 * (margin == 0).sum())
        loss_sum += float(dpo_loss(x, run.algo)[0]) * len(part)
    correct, loss_sum, n = ctx.comm.sum([correct, loss_sum, len(pairs)])
    ctx.sync_weights()  # the generation engine gets the policy's weights at evaluations only
    assert run.rewards is not None  # the plan builds them with the held-out set
    return {"eval/preference_accuracy": correct / max(1.0, n), "eval/loss": loss_sum / max(1.0, n),
            **evaluate(ctx, run.rewards)}


def run(ctx: RunContext) -> dict[str, Any]:
    algo = ctx.recipe.algo
    assert isinstance(algo, DPOConfig)
    assert ctx.roles.reference is not None
    dpo = DPORun(ctx, algo, ctx.roles.reference, ctx.roles.rewards, {})
    if algo.precompute_reference:
        precompute(dpo, ctx.reporter)
    return run_loop(ctx, lambda s: one_step(dpo, s),
                    (lambda: held_out(dpo)) if ctx.has_held_out else None)
