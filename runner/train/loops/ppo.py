"""The PPO loop (Schulman et al. 2017; Ouyang et al. 2022 for the per-token KL penalty).

Roles (built by the assembly): the policy, a frozen reference (the starting policy; only with
``kl_coef > 0``), and a critic (``runner.train.roles.critic``). The rollout-side
packer builds each sequence's inputs once; the policy, reference and critic all read that same
trajectory batch, so no role re-tokenises. Advantages come from GAE over per-token rewards
(-kl_coef x (logp - logp_ref), plus the sequence score at its last token).

One step is three plain functions, each with explicit inputs and outputs:

- ``produce``: this rank's prompts from the global cursor -> ``samples_per_prompt``
  completions each (a ``Trajectory``);
- ``score``: rewards, the policy's, reference's and critic's values of the sampled tokens
  before the update, and the advantages and returns (GAE, whitened over every rank's batch),
  with the minibatches of every epoch (a ``ScoredPPOBatch``);
- ``consume``: ``ppo_epochs`` x ``minibatches`` optimizer steps of the policy and the critic.

``one_step`` calls them in a row, then pushes the new weights to the engine. Sampling ahead
(``algo.max_off_policy_steps >= 1``) the producer also computes the rewards (``rewarded``) right
after it samples a batch, and ``score`` takes them as they are.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import torch

from runner.algorithms.grpo import engine_is_weights
from runner.algorithms.ppo import PPOLossInputs, ppo_advantages, ppo_loss
from runner.packers.base import PolicyBatch, RLPolicyInput
from runner.recipe.schema import PPOConfig
from runner.rewards import RewardSet
from runner.train.assembly.run import RunContext
from runner.train.loops.balance import balances, gather_step
from runner.train.loops.batches import (
    Layout,
    Minibatch,
    epoch_minibatches,
    gather_rows,
    global_whiten,
    mean_packing,
    minibatch_pieces,
    rank_mean,
    reduce_history,
    row_tokens,
    scored_by_tokens,
    select_rows,
    train_minibatch,
    whole_or_rows,
)
from runner.train.loops.held_out import evaluate
from runner.train.loops.loop import run_loop
from runner.train.loops.rollouts import (
    reward_ahead,
    rewarded,
    sample,
    stages,
    step_metrics,
)
from runner.train.loops.trajectory import Trajectory
from runner.train.roles import Trainable
from runner.train.roles.critic import CRITIC
from runner.train.roles.policy import completion_grid


def run(run: RunContext) -> dict[str, Any]:
    algo = run.svc.recipe.algo
    assert isinstance(algo, PPOConfig)
    rewards, critic = run.roles.rewards, run.roles.critic
    assert rewards is not None and critic is not None
    reward_ahead(run, rewards)
    return run_loop(run, lambda step: one_step(run, algo, rewards, critic, step),
                    (lambda: evaluate(run, rewards)) if run.state.has_held_out else None,
                    save=lambda step: run.save(step, {CRITIC: critic}))


@attrs.frozen(eq=False)
class ScoredPPOBatch:
    """A scored PPO trajectory, ready for the optimizer steps of one step: every ``_BT`` tensor
    is [this rank's rows, T-1] on the batch's shifted grid, on the device, computed before the
    update."""

    traj: Trajectory
    layout: Layout
    batch: PolicyBatch  # the rollout-side packer's batch: policy, reference and critic read it
    rewards_all: list[float]  # every rank's rewards, in global row order
    epochs: list[list[Minibatch]]
    old_BT: torch.Tensor  # the policy's logprobs (the behaviour logprobs)
    mask_BT: torch.Tensor  # completion tokens the loss is taken on
    ref_BT: torch.Tensor  # the reference's logprobs (the policy's own without a reference)
    is_BT: torch.Tensor | None  # engine importance weights, with engine_is_correction
    old_values_BT: torch.Tensor  # the critic's values
    adv_BT: torch.Tensor
    returns_BT: torch.Tensor
    logprob_gap: float  # this rank's largest |engine - policy| token logprob
    # With the ranks balanced by tokens (``balances``): this rank's inputs (the rows of
    # ``batch``) and every epoch's minibatches of global rows, which ``everyone`` trains on.
    inputs: tuple[RLPolicyInput, ...] = ()
    global_epochs: list[list[Minibatch]] = attrs.field(factory=list)


def produce(run: RunContext, algo: PPOConfig, step: int) -> Trajectory:
    """This rank's share of the step's prompts, ``samples_per_prompt`` completions each."""
    return sample(run, algo.prompts_per_step, algo.samples_per_prompt, step)


@torch.no_grad()
def score(run: RunContext, algo: PPOConfig, rewards: RewardSet, critic: Trainable,
          traj: Trajectory, step: int) -> ScoredPPOBatch:
    """Rewards (``rewarded``: kept as they are when the producer rewarded the batch); the
    policy's, reference's and critic's values of the sampled tokens; GAE over each completion's
    run of the batch grid, whitened over every rank's batch; and the minibatches of every epoch
    (token-weighted)."""
    recipe, device = run.svc.recipe, run.svc.accelerator.device
    traj = rewarded(run, rewards, traj, step)
    # The rollout-side packer makes the inputs once; policy, reference and critic share them.
    inputs = traj.policy_inputs(run.rollout_packer)
    batch = run.rollout_packer.collate(inputs).to(device)
    temperature, reference = recipe.rollout.temperature, run.roles.reference
    mask_BT = batch.loss_mask_BT[:, 1:].bool()
    lengths = row_tokens(batch, recipe.train)

    def scoring(forward: Any) -> torch.Tensor:  # over every row, by the scoring budget
        return scored_by_tokens(run.svc.comm, recipe.train.logprob_max_tokens_per_microbatch,
                                range(len(inputs)), lengths, tuple(mask_BT.shape),
                                lambda piece: forward(whole_or_rows(batch, piece)))[0]

    old_BT = scoring(lambda b: run.policy.logprobs(b, temperature)[0])
    engine_BT = completion_grid(inputs, [c.logprobs for c in traj.completions],
                                old_BT.shape[1]).to(device)
    # The policy's logprobs before the update against the engine's of the same tokens.
    gap = float(((engine_BT - old_BT).abs() * mask_BT).max()) if mask_BT.any() else 0.0
    is_BT = (engine_is_weights(old_BT, engine_BT, algo.engine_is_cap)
             if algo.engine_is_correction else None)
    ref_BT = (scoring(lambda b: reference.logprobs(b, temperature)[0])
              if reference is not None else old_BT)
    old_values_BT = scoring(critic) * mask_BT
    adv_BT, returns_BT = ppo_advantages(
        torch.tensor(traj.rewards, device=device), old_BT, ref_BT, old_values_BT, mask_BT,
        algo, whiten=lambda x, m: global_whiten(run.svc.comm, x, m))
    rank = run.svc.rank
    layout = Layout(rank.rank, rank.world_size, algo.prompts_per_step, algo.samples_per_prompt)
    weights = gather_rows(run.svc.comm, layout, [float(t) for t in mask_BT.sum(-1).tolist()])
    seed = recipe.run.seed
    epochs = epoch_minibatches(layout, weights, algo.minibatches, seed, step, algo.ppo_epochs)
    rewards_all = gather_rows(run.svc.comm, layout, traj.rewards)
    balanced = balances(run.svc.comm, recipe.train)
    # the same minibatches as sets of global rows (a layout of one rank), split by tokens
    global_epochs = epoch_minibatches(Layout(0, 1, layout.items, layout.chunk), weights,
                                      algo.minibatches, seed, step,
                                      algo.ppo_epochs) if balanced else []
    n = layout.local_rows_count
    return ScoredPPOBatch(traj, layout, batch, rewards_all, epochs, old_BT, mask_BT, ref_BT,
                          is_BT, old_values_BT, adv_BT, returns_BT, gap,
                          tuple(inputs[:n]) if balanced else (), global_epochs)


def everyone(run: RunContext, scored: ScoredPPOBatch) -> ScoredPPOBatch:
    """``scored`` over the rows of every rank, in global row order, for an update whose
    optimizer steps split their rows between the ranks by tokens (``balanced_minibatch``):
    each rank's rows (inputs, behaviour and reference logprobs, engine weights, the critic's
    values, advantages and returns, all computed where the rows were sampled) cross as CPU
    data, and every rank collates the whole batch; a row's values move with it. ``layout``
    stays this rank's."""
    comm, layout, device = run.svc.comm, scored.layout, run.svc.accelerator.device
    n = layout.local_rows_count
    grids = (scored.old_BT, scored.ref_BT, scored.is_BT, scored.old_values_BT, scored.adv_BT,
             scored.returns_BT)
    batch, inputs, joined, _ = gather_step(comm, layout, run.rollout_packer, scored.inputs[:n],
                                           [None if g is None else g[:n] for g in grids], device)
    if batch is None:
        return attrs.evolve(scored, epochs=scored.global_epochs)
    old_BT, ref_BT, is_BT, old_values_BT, adv_BT, returns_BT = joined
    assert (old_BT is not None and ref_BT is not None and old_values_BT is not None
            and adv_BT is not None and returns_BT is not None)
    return attrs.evolve(scored, batch=batch, epochs=scored.global_epochs, old_BT=old_BT,
                        mask_BT=batch.loss_mask_BT[:, 1:].bool(), ref_BT=ref_BT, is_BT=is_BT,
                        old_values_BT=old_values_BT, adv_BT=adv_BT, returns_BT=returns_BT,
                        inputs=tuple(inputs))


def minibatch_loss(run: RunContext, algo: PPOConfig, critic: Trainable, scored: ScoredPPOBatch,
                   idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The PPO loss (policy and value) of rows ``idx`` and its metrics."""
    s = scored
    sub = select_rows(s.batch, idx)
    lp_BT, sub_mask_BT = run.policy.logprobs(sub, run.svc.recipe.rollout.temperature)
    w = lp_BT.shape[1]
    return ppo_loss(PPOLossInputs(
        logprobs_BT=lp_BT, old_logprobs_BT=s.old_BT[idx, :w], adv_BT=s.adv_BT[idx, :w],
        mask_BT=sub_mask_BT, values_BT=critic(sub), old_values_BT=s.old_values_BT[idx, :w],
        returns_BT=s.returns_BT[idx, :w],
        is_weights_BT=None if s.is_BT is None else s.is_BT[idx, :w]), algo)


def consume(run: RunContext, algo: PPOConfig, critic: Trainable, scored: ScoredPPOBatch
            ) -> dict[str, float]:
    """The step's optimizer steps of the policy and the critic over ``scored``; returns the
    reduced metrics, the learning rate, ``kl`` (the policy's token KL estimate to the reference
    before the update, over every rank's tokens) and ``rollout/logprob_gap``."""
    recipe, policy = run.svc.recipe, run.policy
    # balanced: every rank holds every row, and each optimizer step's are split by tokens
    balanced = balances(run.svc.comm, recipe.train)
    work = everyone(run, scored) if balanced else scored
    loss_fn = partial(minibatch_loss, run, algo, critic, work)
    lengths = row_tokens(work.batch, recipe.train)
    history: list[dict[str, float]] = []
    packings: list[dict[str, float]] = []
    for mbs in work.epochs:
        for mb in mbs:
            mb, pieces, accum = minibatch_pieces(run.svc.comm, scored.layout, recipe.train, mb,
                                                 lengths, packings)
            history.append(train_minibatch([policy, critic], mb, loss_fn, accum,
                                           scored.layout.world, recipe.train.max_grad_norm,
                                           pieces))
    policy.scheduler.step()
    critic.scheduler.step()
    s = scored
    kl_sum, n_tok = run.svc.comm.sum([float(((s.old_BT - s.ref_BT) * s.mask_BT).sum()),
                                  float(s.mask_BT.sum())])
    return {**rank_mean(run.svc.comm, policy.padding_metrics(s.batch)),
            "kl": kl_sum / max(1.0, n_tok),
            "rollout/logprob_gap": max(run.svc.comm.gather(s.logprob_gap)),
            "lr": policy.scheduler.get_last_lr()[0], **reduce_history(run.svc.comm, history),
            **mean_packing(packings)}


def one_step(run: RunContext, algo: PPOConfig, rewards: RewardSet, critic: Trainable,
             step: int) -> dict[str, Any]:
    """produce -> score -> consume, then the new weights to the engine; the step's metrics."""
    scored, metrics, seconds = stages(
        run, step, algo.samples_per_prompt, lambda: produce(run, algo, step),
        lambda traj: score(run, algo, rewards, critic, traj, step),
        lambda s: consume(run, algo, critic, s))
    return step_metrics(run, scored.traj, scored.rewards_all, seconds, algo.ppo_epochs) | metrics
