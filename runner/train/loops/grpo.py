"""The GRPO loop (Shao et al. 2024, DeepSeekMath): sample a group of completions per prompt,
score them, normalise rewards within each group, and take clipped policy-gradient steps.

One step is three plain functions, each with explicit inputs and outputs:

- ``produce``: this rank's prompts from the global cursor -> ``group_size`` completions each,
  with the engine's token logprobs (a ``Trajectory``);
- ``score``: rewards (with the overlong shaping) -> the optional shared-prefix filter and
  truncation mask, the collated batch, the minibatches of every epoch, the behaviour and
  reference logprobs, and the advantages of ``algo.advantage`` (from every rank's rewards, so
  ``scale_rewards = "batch"`` and REINFORCE++'s normalisation use the global batch) (a
  ``ScoredBatch``);
- ``consume``: ``ppo_epochs`` x ``minibatches`` optimizer steps over minibatches of the global
  batch.

``one_step`` calls them in a row, then pushes the new weights to the engine. Sampling ahead
(``algo.max_off_policy_steps >= 1``) the producer also runs ``score``'s first stage, the rewards
(``rewarded``), right after it samples a batch, and ``score`` takes those rewards as they are.
With ``algo.dynamic_sampling = "filter"`` the step's ``produce`` is ``dynamic.draw`` (DAPO's
dynamic sampling: batches drawn and rewarded until the step has its groups with unequal
rewards), and ``score`` takes the kept groups as they are (``score_rewarded``); sampling ahead,
the producer draws the batches and the step decides on them (``dynamic.taken``). Everything random
is seeded from (run seed, step) and each prompt's global position, so a resumed run repeats the
uninterrupted one exactly, and the same global batch trains the same way on any number of ranks.
"""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import torch

from runner.algorithms.advantages import AdvantageInputs, abs_sum_count, advantages
from runner.algorithms.grpo import GRPOLossInputs, engine_is_weights, grpo_loss, row_weights
from runner.packers.base import PolicyBatch, RLPolicyInput
from runner.ranks.collective import Collective
from runner.recipe.schema import GRPOConfig
from runner.rewards import RewardSet
from runner.train.assembly.run import RunContext
from runner.train.loops import dynamic
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
    train_minibatch_keeping,
    whole_or_rows,
)
from runner.train.loops.held_out import evaluate
from runner.train.loops.loop import run_loop
from runner.train.loops.rollouts import (
    reward_ahead,
    rewarded,
    sample,
    shared_prefixes,
    stages,
    step_metrics,
)
from runner.train.loops.trajectory import Trajectory, without_loss
from runner.train.roles.policy import completion_grid


def run(run: RunContext) -> dict[str, Any]:
    algo = run.svc.recipe.algo
    assert isinstance(algo, GRPOConfig)
    rewards = run.roles.rewards
    assert rewards is not None
    dynamic.refuse_held(run, algo)
    if algo.dynamic_sampling == "off":
        reward_ahead(run, rewards)
    else:  # (dynamic sampling rewards as it draws: the producer draws by its rule)
        dynamic.sample_ahead_with(run, algo, rewards)
    return run_loop(run, lambda step: one_step(run, algo, rewards, step),
                    (lambda: evaluate(run, rewards)) if run.state.has_held_out else None)


@attrs.frozen(eq=False)
class ScoredBatch:
    """A scored trajectory, ready for the optimizer steps of one step (tensors on the device).

    ``old_BT`` holds the behaviour logprobs of every row that ``consume`` does not score
    itself: with ``old_logprobs = "policy"`` the first minibatch's rows are filled by that
    optimizer step's own (detached) forward, which runs the weights that sampled them.
    """

    traj: Trajectory
    layout: Layout
    batch: PolicyBatch
    rewards_all: list[float]  # every rank's rewards, in global row order
    adv_B: torch.Tensor  # this rank's rows: [B] per sequence, or [B, T] per token
    epochs: list[list[Minibatch]]
    engine_BT: torch.Tensor  # the engine's logprobs of the sampled tokens, on the batch's grid
    old_BT: torch.Tensor
    ref_BT: torch.Tensor | None
    own_old: bool  # the first minibatch's behaviour logprobs are its own forward's
    ignore_prefix: list[int] | None  # shared-prefix tokens left out of the loss, per row
    adv_abs_mean: float  # mean |A| over every rank's sequences (or tokens, per-token A)
    # With the ranks balanced by tokens (``balances``): this rank's policy inputs (the rows of
    # ``batch``) and every epoch's minibatches of global rows, which ``everyone`` trains on.
    inputs: tuple[RLPolicyInput, ...] = ()
    global_epochs: list[list[Minibatch]] = attrs.field(factory=list)


def produce(run: RunContext, algo: GRPOConfig, step: int) -> Trajectory:
    """This rank's share of the step's prompts, ``group_size`` completions each."""
    return sample(run, algo.prompts_per_step, algo.group_size, step)


def score(run: RunContext, algo: GRPOConfig, rewards: RewardSet, traj: Trajectory,
          step: int) -> ScoredBatch:
    """Rewards (``rewarded``: kept as they are when the producer rewarded the batch), then
    ``score_rewarded`` of the step's full batch."""
    traj = rewarded(run, rewards, traj, step)
    return score_rewarded(run, algo, traj, step, algo.prompts_per_step)


def score_rewarded(run: RunContext, algo: GRPOConfig, traj: Trajectory, step: int,
                   groups: int) -> ScoredBatch:
    """A rewarded batch of ``groups`` groups over every rank (this rank's by the data rule:
    its groups r, r + world, ...; rows after them are padding, with no loss), its minibatches
    (completions that hit the token limit out of the loss with ``mask_truncated``), the
    logprobs the loss compares against (behaviour: the engine's or the policy's; reference with
    ``kl_beta``) and the advantages of ``algo.advantage``."""
    recipe, policy, device = run.svc.recipe, run.policy, run.svc.accelerator.device
    ignore = shared_prefixes(traj, algo.group_size) if algo.shared_prefix_filter else None
    rank = run.svc.rank
    layout = Layout(rank.rank, rank.world_size, groups, algo.group_size)
    n = layout.local_rows_count
    rewards_all = gather_rows(run.svc.comm, layout, traj.rewards[:n])
    inputs = traj.policy_inputs(run.policy_packer, ignore)
    inputs = without_loss(inputs, [i >= n or (algo.mask_truncated and t)
                                   for i, t in enumerate(traj.truncated)])
    batch = run.policy_packer.collate(inputs).to(device)
    width = batch.input_ids_BT.shape[1] - 1
    temperature = recipe.rollout.temperature
    tokens = [float(t) for t in batch.loss_mask_BT[:n, 1:].sum(-1).tolist()]
    weights = gather_rows(run.svc.comm, layout, row_weights(algo.loss_agg, tokens))
    seed = recipe.run.seed
    epochs = epoch_minibatches(layout, weights, algo.minibatches, seed, step, algo.ppo_epochs)
    balanced = balances(run.svc.comm, recipe.train)
    # the same minibatches as sets of global rows (a layout of one rank), split by tokens
    global_epochs = epoch_minibatches(Layout(0, 1, layout.items, layout.chunk), weights,
                                      algo.minibatches, seed, step,
                                      algo.ppo_epochs) if balanced else []
    # The first optimizer step trains on freshly sampled data with the weights that sampled it:
    # its rows' behaviour logprobs are that step's own forward (detached). Only the other rows
    # need a separate scoring forward, and none when there is one minibatch. (A batch of no
    # group, dynamic sampling's when it kept none, has no minibatch: no optimizer step.)
    first_rows = set(epochs[0][0].rows) if epochs[0] else set()
    lengths = row_tokens(batch, recipe.train)

    def scoring(rows: Any, forward: Any) -> torch.Tensor:
        return scored_by_tokens(run.svc.comm, recipe.train.logprob_max_tokens_per_microbatch,
                                rows, lengths, (len(inputs), width),
                                lambda piece: forward(whole_or_rows(batch, piece)))[0]

    others = [r for r in range(len(traj.completions)) if r not in first_rows]
    with torch.no_grad():
        engine_BT = completion_grid(inputs, [c.logprobs for c in traj.completions],
                                    width).to(device)
        old_BT = engine_BT
        if algo.old_logprobs == "policy":
            dtype = torch.promote_types(next(policy.model.parameters()).dtype, torch.float32)
            old_BT = torch.zeros_like(engine_BT, dtype=dtype)
            if algo.minibatches > 1:
                # Every rank runs these forwards (DDP's forwards are collective); one that holds
                # no row outside the first minibatch scores its row 0 and keeps nothing.
                scored = scoring(others, lambda b: policy.logprobs(b, temperature)[0])
                if others:
                    old_BT[torch.tensor(others, device=device)] = scored[others].to(dtype)
        reference = run.roles.reference
        ref_BT = (scoring(range(len(inputs)), lambda b: reference.logprobs(b, temperature)[0])
                  if reference is not None else None)
    adv_B, adv_abs_mean = advantages_of(run, algo, layout, rewards_all, batch, engine_BT, ref_BT)
    # (A rank holding no row of the first minibatch only takes part with a zero-weighted row.)
    own_old = algo.old_logprobs == "policy" and bool(first_rows)
    return ScoredBatch(traj, layout, batch, rewards_all, adv_B, epochs, engine_BT, old_BT,
                       ref_BT, own_old, None if ignore is None else ignore[:n], adv_abs_mean,
                       tuple(inputs[:n]) if balanced else (), global_epochs)


def everyone(run: RunContext, scored: ScoredBatch) -> ScoredBatch:
    """``scored`` over the rows of every rank, in global row order, for an update whose
    optimizer steps split their rows between the ranks by tokens (``balanced_minibatch``):
    each rank's rows (policy inputs, the engine's, behaviour and reference logprobs, the
    advantages) cross as plain CPU data, and every rank collates the whole batch. Every row
    keeps what ``score`` computed for it where it was sampled, so the update is the same; the
    first minibatch's behaviour logprobs are still its own forward's, on whichever rank trains
    the row (``consume`` shares them for the later epochs). ``layout`` stays this rank's."""
    comm, layout, device = run.svc.comm, scored.layout, run.svc.accelerator.device
    n = layout.local_rows_count
    grids = (scored.adv_B, scored.engine_BT, scored.old_BT, scored.ref_BT)
    batch, inputs, joined, own_old = gather_step(
        comm, layout, run.policy_packer, scored.inputs[:n],
        [None if g is None else g[:n] for g in grids], device, scored.own_old)
    adv_B, engine_BT, old_BT, ref_BT = joined
    assert adv_B is not None and engine_BT is not None and old_BT is not None
    return attrs.evolve(scored, batch=scored.batch if batch is None else batch, adv_B=adv_B,
                        epochs=scored.global_epochs, engine_BT=engine_BT, old_BT=old_BT,
                        ref_BT=ref_BT, own_old=own_old, inputs=tuple(inputs))


def advantages_of(run: RunContext, algo: GRPOConfig, layout: Layout, rewards_all: list[float],
                  batch: PolicyBatch, engine_BT: torch.Tensor, ref_BT: torch.Tensor | None
                  ) -> tuple[torch.Tensor, float]:
    """This rank's advantages by ``algo.advantage`` (on the device) and their mean magnitude
    over every rank. The group estimators read every rank's rewards; the batch-normalised ones
    normalise over every rank's valid tokens. The per-token KL an estimator may fold into its
    rewards is log pi_behaviour - log pi_ref of the sampled tokens, with the engine's logprobs
    as the behaviour's (the policy's up to numerics; known before any training forward)."""
    mask_BT = batch.loss_mask_BT[:, 1:].to(torch.bool)
    n = layout.local_rows_count  # rows after them: padding, with no loss
    if not rewards_all:  # a batch of no group (dynamic sampling kept none): nothing to train
        return torch.zeros(mask_BT.shape[0], device=mask_BT.device), 0.0
    rows_B = torch.tensor([layout.global_row(i) if i < n else 0
                           for i in range(mask_BT.shape[0])])
    kl_BT = None if ref_BT is None else (engine_BT - ref_BT).detach()
    adv = advantages(algo.advantage, AdvantageInputs(
        rewards_N=torch.tensor(rewards_all), rows_B=rows_B, mask_BT=mask_BT, kl_BT=kl_BT,
        group_size=algo.group_size, scale=algo.scale_rewards, kl_beta=algo.kl_beta,
        whiten=lambda x, m: global_whiten(run.svc.comm, x, m)))
    total, count = run.svc.comm.sum(list(abs_sum_count(adv[:n], mask_BT[:n])))
    return adv.to(mask_BT.device), total / max(1.0, count)


Kept = tuple[torch.Tensor, torch.Tensor]  # a micro-batch's detached logprobs and their mask


def minibatch_loss(run: RunContext, algo: GRPOConfig, scored: ScoredBatch, old_BT: torch.Tensor,
                   first: bool, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any], Kept]:
    """The GRPO loss of rows ``idx`` and its metrics, with the rows' detached token logprobs
    (the behaviour logprobs of the first minibatch, and its engine gap). In the first
    minibatch with ``own_old`` the behaviour logprobs are this forward's own."""
    s = scored
    sub = select_rows(s.batch, idx)
    lp_BT, mask_BT = run.policy.logprobs(sub, run.svc.recipe.rollout.temperature)
    w = lp_BT.shape[1]
    old = lp_BT.detach() if first and s.own_old else old_BT[idx, :w]
    is_w = (engine_is_weights(old, s.engine_BT[idx, :w], algo.engine_is_cap)
            if algo.engine_is_correction else None)
    adv = s.adv_B[idx] if s.adv_B.ndim == 1 else s.adv_B[idx, :w]
    loss, metrics = grpo_loss(GRPOLossInputs(
        logprobs_BT=lp_BT, old_logprobs_BT=old, adv_B=adv,
        ref_logprobs_BT=None if s.ref_BT is None else s.ref_BT[idx, :w], mask_BT=mask_BT,
        max_tokens=run.svc.recipe.rollout.max_new_tokens, is_weights_BT=is_w), algo)
    return loss, metrics, (lp_BT.detach(), mask_BT)


def consume(run: RunContext, algo: GRPOConfig, scored: ScoredBatch) -> dict[str, float]:
    """The step's optimizer steps over ``scored``; returns the reduced metrics, the learning
    rate and ``rollout/logprob_gap`` (the engine's logprobs against the first optimizer step's
    forward, which runs the weights the engine sampled with: they differ only by numerics, and
    a stale engine shows here)."""
    recipe, policy, comm = run.svc.recipe, run.policy, run.svc.comm
    # balanced: every rank holds every row, and each optimizer step's are split by tokens
    balanced = balances(comm, recipe.train)
    work = everyone(run, scored) if balanced else scored
    old_BT = work.old_BT
    history: list[dict[str, float]] = []
    packings: list[dict[str, float]] = []
    lengths = row_tokens(work.batch, recipe.train)
    gap = torch.zeros(())
    for epoch, mbs in enumerate(work.epochs):
        for k, mb in enumerate(mbs):
            first = epoch == 0 and k == 0

            def loss_fn(idx: torch.Tensor, old_BT: torch.Tensor = old_BT, first: bool = first
                        ) -> tuple[torch.Tensor, dict[str, Any], Kept]:
                return minibatch_loss(run, algo, work, old_BT, first, idx)

            mb, pieces, accum = minibatch_pieces(comm, scored.layout, recipe.train, mb, lengths,
                                                 packings)
            metrics, kept = train_minibatch_keeping([policy], mb, loss_fn, accum,
                                                    scored.layout.world, recipe.train.max_grad_norm,
                                                    pieces)
            history.append(metrics)
            if first:
                gap = _engine_gap(work.engine_BT, kept, gap)
                if work.own_old:  # kept for the later epochs
                    if balanced and len(work.epochs) > 1:  # every rank's, for any rank
                        kept = _shared(comm, kept, set(mb.rows), old_BT)
                    old_BT = _with_rows(old_BT, kept)
    with warnings.catch_warnings():
        # a dynamic-sampling step that kept no group takes no optimizer step; the schedule
        # follows the step count all the same
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        policy.scheduler.step()
    out = reduce_history(run.svc.comm, history)
    out["lr"] = policy.scheduler.get_last_lr()[0]
    out["adv_abs_mean"] = scored.adv_abs_mean
    out.update(rank_mean(run.svc.comm, policy.padding_metrics(scored.batch)))
    out.update(mean_packing(packings))
    out["rollout/logprob_gap"] = max(run.svc.comm.gather(float(gap)))
    return out


def _engine_gap(engine_BT: torch.Tensor, kept: list[tuple[torch.Tensor, Kept]],
                gap: torch.Tensor) -> torch.Tensor:
    """The largest |engine - policy| token logprob over the kept rows' completion tokens."""
    for rows, (lp_BT, mask_BT) in kept:
        w = lp_BT.shape[1]
        gap = torch.maximum(gap, ((engine_BT[rows, :w] - lp_BT).abs() * mask_BT).max())
    return gap


def _shared(comm: Collective, kept: list[tuple[torch.Tensor, Kept]], mine: set[int],
            like: torch.Tensor) -> list[tuple[torch.Tensor, Kept]]:
    """Every rank's ``kept`` micro-batches of its share ``mine`` (not a pad's row), as CPU
    tensors crossing the ranks, back on ``like``'s device."""
    own = [(rows.cpu(), lp_BT.cpu(), mask_BT.cpu()) for rows, (lp_BT, mask_BT) in kept
           if set(rows.tolist()) <= mine]
    return [(rows.to(like.device), (lp_BT.to(like.device), mask_BT.to(like.device)))
            for per_rank in comm.gather(own) for rows, lp_BT, mask_BT in per_rank]


def _with_rows(old_BT: torch.Tensor, kept: list[tuple[torch.Tensor, Kept]]) -> torch.Tensor:
    """``old_BT`` with the kept rows' logprobs written over theirs (a new tensor)."""
    out = old_BT.clone()
    for rows, (lp_BT, _) in kept:
        out[rows, :lp_BT.shape[1]] = lp_BT
    return out


def one_step(run: RunContext, algo: GRPOConfig, rewards: RewardSet, step: int) -> dict[str, Any]:
    """One step by ``algo.dynamic_sampling`` (``STEPS``); the step's metrics."""
    return STEPS[algo.dynamic_sampling](run, algo, rewards, step)


def plain_step(run: RunContext, algo: GRPOConfig, rewards: RewardSet, step: int
               ) -> dict[str, Any]:
    """produce -> score -> consume, then the new weights to the engine; the step's metrics."""
    scored, metrics, seconds = stages(
        run, step, algo.group_size, lambda: produce(run, algo, step),
        lambda traj: score(run, algo, rewards, traj, step),
        lambda s: consume(run, algo, s) | _prefix_metrics(run, s))
    _show_sample(run, scored, step)
    return step_metrics(run, scored.traj, scored.rewards_all, seconds, algo.ppo_epochs) | metrics


def filtered_step(run: RunContext, algo: GRPOConfig, rewards: RewardSet, step: int
                  ) -> dict[str, Any]:
    """DAPO's dynamic sampling: draw (and reward) batches until the step's groups are full
    (``dynamic.draw``, or sampling ahead the producer's draw, taken by ``dynamic.taken``),
    score and consume the kept groups. The reward, length and rollout metrics are those of
    every completion drawn; ``perf/train_tok_s`` counts the trained."""
    (drawn, scored), metrics, seconds = stages(
        run, step, algo.group_size, lambda: dynamic.draw(run, algo, rewards, step),
        lambda d: (d, score_rewarded(run, algo, d.traj, step, d.kept)),
        lambda ds: consume(run, algo, ds[1]) | _prefix_metrics(run, ds[1]),
        taken=lambda produced: dynamic.taken(run, algo, step, produced))
    _show_sample(run, scored, step)
    n = scored.layout.local_rows_count
    trained = sum(len(c.token_ids) for c in scored.traj.completions[:n])
    return (step_metrics(run, drawn.drawn, drawn.drawn_rewards, seconds, algo.ppo_epochs)
            | {"perf/train_tok_s": algo.ppo_epochs * trained / max(seconds["update"], 1e-9)}
            | drawn.metrics | metrics)


STEPS = {"off": plain_step, "filter": filtered_step}  # algo.dynamic_sampling -> one step


def _show_sample(run: RunContext, scored: ScoredBatch, step: int) -> None:
    traj, every = scored.traj, run.svc.recipe.logging.sample_every
    if every and step % every == 0:
        run.svc.reporter.sample(step, str(traj.items[0].prompt), traj.texts[0], traj.rewards[0])


def _prefix_metrics(run: RunContext, scored: ScoredBatch) -> dict[str, float]:
    """``prefix_tokens_filtered``: shared-prefix tokens left out of the loss per global row."""
    if scored.ignore_prefix is None:
        return {}
    layout = scored.layout
    return {"prefix_tokens_filtered":
            sum(gather_rows(run.svc.comm, layout, scored.ignore_prefix)) / layout.global_rows}

