"""The on-policy distillation loop (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025).

The student samples completions; the teacher scores the student's tokens; the per-token reverse
KL estimate ``logp_student - logp_teacher`` of each sampled token, negated, is its advantage in
a clipped policy-gradient step. ``same_tokenizer`` mode scores the student's ids directly.
``cross_token_multimodal`` mode lets the teacher have its own tokenizer
(``runner.train.roles.teacher``, built by the assembly).

One step is three plain functions, each with explicit inputs and outputs:

- ``produce``: this rank's prompts from the global cursor -> ``samples_per_prompt``
  completions each (a ``Trajectory``);
- ``score``: rewards (logged, not trained on), the teacher's logprobs of the sampled tokens
  (none with ``full_kl``: the loss's own teacher forward gives them) and, with several epochs,
  the behaviour logprobs (a ``ScoredOPDBatch``);
- ``consume``: one optimizer step over the whole global batch per epoch.

``one_step`` calls them in a row, then pushes the new weights to the engine.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import torch

from runner.algorithms.logprobs import token_logprobs
from runner.algorithms.opd import (
    OPDLossInputs,
    full_reverse_kl,
    opd_loss,
    sampled_reverse_kl,
)
from runner.packers.base import PolicyBatch, RLPolicyInput
from runner.recipe.schema import OPDConfig
from runner.rewards import RewardSet
from runner.train.assembly.run import RunContext
from runner.train.loops.balance import balances, gather_step
from runner.train.loops.batches import (
    Layout,
    Minibatch,
    gather_rows,
    lockstep,
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
    Trajectory,
    position_seeds,
    reward_trajectory,
    roll_out,
    sample,
    sampling,
    stages,
    step_metrics,
)
from runner.train.roles.policy import completion_grid, first_loss_column
from runner.train.roles.teacher import Teacher


def run(run: RunContext) -> dict[str, Any]:
    algo = run.svc.recipe.algo
    assert isinstance(algo, OPDConfig)
    teacher, rewards = run.roles.teacher, run.roles.rewards
    assert teacher is not None and rewards is not None

    def held_out() -> dict[str, float]:
        return evaluate(run, rewards) | held_out_reverse_kl(run, teacher)

    return run_loop(run, lambda step: one_step(run, algo, teacher, rewards, step),
                    held_out if run.state.has_held_out else None)


# The held-out reverse KL samples with this seed at every evaluation, so evaluations differ only
# by the student's weights.
HELD_OUT_SEED = 7_919


@torch.no_grad()
def held_out_reverse_kl(run: RunContext, teacher: Teacher) -> dict[str, float]:
    """The student's reverse KL to the teacher on the held-out prompts: one completion each,
    sampled like the training rollouts, per-token ``logp_student - logp_teacher`` averaged over
    every completion token of every rank (the estimate the training metric ``reverse_kl``
    reports). With one vocabulary also ``eval/reverse_kl_exact``: the full-vocabulary
    KL(student || teacher) at the same positions, without the sampling noise of the estimate."""
    total = count = exact = 0.0
    items = run.state.val_items
    # A rank without held-out items forwards the policy (DDP or sharded) and a sharded teacher
    # as the others do, in the same order.
    device = run.svc.accelerator.device
    with lockstep(run.svc.comm, int(bool(items)), run.policy_packer, device, run.policy,
                  teacher.frozen):
        if items:
            seeds = position_seeds(run, HELD_OUT_SEED, 0, len(items))
            traj = roll_out(run.rollout, items, sampling(run.svc.recipe.rollout, 1, 0), seeds)
            temperature = run.svc.recipe.rollout.temperature
            inputs = traj.policy_inputs(run.policy_packer)
            batch = run.policy_packer.collate(inputs).to(device)
            mask_BT = batch.loss_mask_BT[:, 1:].bool()
            if teacher.mode == "same_tokenizer":  # one forward each: the logits give both numbers
                start = first_loss_column(batch)  # the LM heads skip the prompts' columns
                mask_BT = mask_BT[:, start:]
                labels_BT = batch.input_ids_BT[:, 1 + start:]
                student = run.policy.logits(batch, start) / temperature
                teacher_logits = teacher.logits(batch, temperature, start)
                student_BT = token_logprobs(student, labels_BT)
                teacher_BT = token_logprobs(teacher_logits, labels_BT)
                exact = float(full_reverse_kl(student, teacher_logits[..., :student.shape[-1]],
                                              mask_BT).sum())
            else:
                student_BT = run.policy.logprobs(batch, temperature)[0]
                teacher_BT = teacher.logprobs(traj, inputs, student_BT.shape[1], temperature)
            total = float((sampled_reverse_kl(student_BT, teacher_BT) * mask_BT).sum())
            count = float(mask_BT.sum())
    total, count, exact = run.svc.comm.sum([total, count, exact])
    out = {"eval/reverse_kl": total / max(1.0, count)}
    if teacher.mode == "same_tokenizer":
        out["eval/reverse_kl_exact"] = exact / max(1.0, count)
    return out


@attrs.frozen(eq=False)
class ScoredOPDBatch:
    """A scored OPD trajectory, ready for the optimizer steps of one step (tensors on the
    device; ``_BT`` ones are [this rank's rows, T-1] on the batch's shifted grid)."""

    traj: Trajectory
    layout: Layout
    batch: PolicyBatch
    rewards_all: list[float]  # every rank's rewards, in global row order
    whole: Minibatch  # every row of the global batch, token-weighted
    teacher_BT: torch.Tensor | None  # None with full_kl: the loss's teacher forward gives them
    old_BT: torch.Tensor | None  # None with one epoch: the first forward's own are behaviour
    # With the ranks balanced by tokens (``balances``): this rank's inputs (the rows of
    # ``batch``) and every row's weight in global row order, which ``everyone`` trains on.
    inputs: tuple[RLPolicyInput, ...] = ()
    weights_all: list[float] = attrs.field(factory=list)


def produce(run: RunContext, algo: OPDConfig, step: int) -> Trajectory:
    """This rank's share of the step's prompts, ``samples_per_prompt`` completions each."""
    return sample(run, algo.prompts_per_step, algo.samples_per_prompt, step)


def score(run: RunContext, algo: OPDConfig, teacher: Teacher, rewards: RewardSet,
          traj: Trajectory, step: int) -> ScoredOPDBatch:
    """Rewards (logged only), the collated batch, the teacher's logprobs of the sampled tokens
    and, with ``ppo_epochs > 1``, the behaviour logprobs."""
    train, temperature = run.svc.recipe.train, run.svc.recipe.rollout.temperature
    traj = reward_trajectory(traj, rewards, step)
    inputs = traj.policy_inputs(run.policy_packer)
    batch = run.policy_packer.collate(inputs).to(run.svc.accelerator.device)
    mask_BT = batch.loss_mask_BT[:, 1:].bool()
    lengths = row_tokens(batch, train)

    def scoring(forward: Any) -> torch.Tensor:  # over every row, by the scoring budget
        return scored_by_tokens(run.svc.comm, train.logprob_max_tokens_per_microbatch,
                                range(len(inputs)), lengths, tuple(mask_BT.shape), forward)[0]

    # With the full KL the loss's own teacher forward (its logits) also gives the teacher's
    # logprobs of the sampled tokens: no separate scoring forward.
    teacher_BT = (None if algo.full_kl else scoring(
        lambda rows: teacher.logprobs(_rows_of(traj, rows), [inputs[r] for r in rows],
                                      mask_BT.shape[1], temperature)))
    # One pass over freshly sampled data: the behaviour logprobs are the first forward's own
    # (detached), so no separate scoring forward is needed.
    old_BT = None
    if algo.max_off_policy_steps >= 1:
        # Sampled by an older policy: the ratio is against the engine's logprobs (behaviour).
        old_BT = completion_grid(inputs, [c.logprobs for c in traj.completions],
                                 mask_BT.shape[1]).to(batch.input_ids_BT.device)
    elif algo.ppo_epochs > 1:
        with torch.no_grad():
            old_BT = scoring(lambda rows: run.policy.logprobs(whole_or_rows(batch, rows),
                                                              temperature)[0])
    rank = run.svc.rank
    layout = Layout(rank.rank, rank.world_size, algo.prompts_per_step, algo.samples_per_prompt)
    tokens = [float(t) for t in mask_BT.sum(-1).tolist()]
    # One optimizer step per epoch over the whole global batch (token mean).
    whole = Minibatch(list(range(len(tokens))), tokens, run.svc.comm.sum([sum(tokens)])[0])
    rewards_all = gather_rows(run.svc.comm, layout, traj.rewards)
    balanced = balances(run.svc.comm, train)
    n = layout.local_rows_count
    return ScoredOPDBatch(traj, layout, batch, rewards_all, whole, teacher_BT, old_BT,
                          tuple(inputs[:n]) if balanced else (),
                          gather_rows(run.svc.comm, layout, tokens[:n]) if balanced else [])


def everyone(run: RunContext, scored: ScoredOPDBatch) -> ScoredOPDBatch:
    """``scored`` over the rows of every rank, in global row order, for an update whose
    optimizer steps split their rows between the ranks by tokens (``balanced_minibatch``):
    each rank's rows (inputs, the teacher's and behaviour logprobs computed where they were
    sampled) cross as CPU data, every rank collates the whole batch, and ``whole`` is every
    global row. ``layout`` stays this rank's."""
    comm, layout, device = run.svc.comm, scored.layout, run.svc.accelerator.device
    n = layout.local_rows_count
    grids = (scored.teacher_BT, scored.old_BT)
    batch, inputs, joined, _ = gather_step(comm, layout, run.policy_packer, scored.inputs[:n],
                                           [None if g is None else g[:n] for g in grids], device)
    weights = scored.weights_all
    whole = Minibatch(list(range(len(weights))), list(weights), scored.whole.total)
    if batch is None:
        return attrs.evolve(scored, whole=whole)
    teacher_BT, old_BT = joined
    return attrs.evolve(scored, batch=batch, whole=whole, teacher_BT=teacher_BT,
                        old_BT=old_BT, inputs=tuple(inputs))


def minibatch_loss(run: RunContext, algo: OPDConfig, teacher: Teacher, scored: ScoredOPDBatch,
                   rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The OPD loss of rows ``rows`` and its metrics."""
    temperature = run.svc.recipe.rollout.temperature
    sub = select_rows(scored.batch, rows)
    start = 0  # the first column of the shifted grid the loss reads
    if algo.full_kl:  # the full-vocabulary KL needs every logit of the completion positions
        start = first_loss_column(sub)  # both LM heads skip the columns of prompts only
        labels_BT = sub.input_ids_BT[:, 1 + start:]
        logits = run.policy.logits(sub, start) / temperature
        lp_BT = token_logprobs(logits, labels_BT)
        teacher_logits = teacher.logits(sub, temperature, start)
        teacher_lp_BT = token_logprobs(teacher_logits, labels_BT)  # its whole vocabulary
        teacher_logits = teacher_logits[..., :logits.shape[-1]]
    else:
        assert scored.teacher_BT is not None
        lp_BT, logits, teacher_logits = run.policy.logprobs(sub, temperature)[0], None, None
        teacher_lp_BT = scored.teacher_BT[rows, :lp_BT.shape[1]]
    old_BT = scored.old_BT
    old = lp_BT.detach() if old_BT is None else old_BT[rows, start:start + lp_BT.shape[1]]
    return opd_loss(OPDLossInputs(
        logprobs_BT=lp_BT, old_logprobs_BT=old, teacher_logprobs_BT=teacher_lp_BT,
        mask_BT=sub.loss_mask_BT[:, 1 + start:].bool(), student_logits_BTV=logits,
        teacher_logits_BTV=teacher_logits), algo)


def consume(run: RunContext, algo: OPDConfig, teacher: Teacher, scored: ScoredOPDBatch
            ) -> dict[str, float]:
    """``ppo_epochs`` optimizer steps over the whole batch; the reduced metrics and the
    learning rate."""
    recipe, policy = run.svc.recipe, run.policy
    # balanced: every rank holds every row, and each optimizer step's are split by tokens
    balanced = balances(run.svc.comm, recipe.train)
    work = everyone(run, scored) if balanced else scored
    loss_fn = partial(minibatch_loss, run, algo, teacher, work)
    lengths = row_tokens(work.batch, recipe.train)
    history: list[dict[str, float]] = []
    packings: list[dict[str, float]] = []
    for _ in range(algo.ppo_epochs):
        mb, pieces, accum = minibatch_pieces(run.svc.comm, scored.layout, recipe.train,
                                             work.whole, lengths, packings)
        history.append(train_minibatch([policy], mb, loss_fn, accum,
                                       scored.layout.world, recipe.train.max_grad_norm, pieces))
    policy.scheduler.step()
    return {**rank_mean(run.svc.comm, policy.padding_metrics(scored.batch)),
            **reduce_history(run.svc.comm, history), "lr": policy.scheduler.get_last_lr()[0],
            **mean_packing(packings)}


def _rows_of(traj: Trajectory, rows: list[int]) -> Trajectory:
    """The completions ``rows`` of ``traj`` (what the teacher reads of them)."""
    if rows == list(range(len(traj.completions))):
        return traj
    return attrs.evolve(traj, items=tuple(traj.items[r] for r in rows),
                        prompt_ids=tuple(traj.prompt_ids[r] for r in rows),
                        completions=tuple(traj.completions[r] for r in rows), rewards=(),
                        loss_masks=tuple(traj.loss_masks[r] for r in rows)
                        if traj.loss_masks else ())


def one_step(run: RunContext, algo: OPDConfig, teacher: Teacher, rewards: RewardSet,
             step: int) -> dict[str, Any]:
    """produce -> score -> consume, then the new weights to the engine; the step's metrics."""
    scored, metrics, seconds = stages(
        run, step, algo.samples_per_prompt, lambda: produce(run, algo, step),
        lambda traj: score(run, algo, teacher, rewards, traj, step),
        lambda s: consume(run, algo, teacher, s), scoring="teacher")
    return step_metrics(run, scored.traj, scored.rewards_all, seconds, algo.ppo_epochs) | metrics
