"""DAPO's dynamic sampling for GRPO (``algo.dynamic_sampling = "filter"``; Yu et al. 2025,
arXiv:2503.14476, section 3.2): a group whose rewards are all equal has zero advantage under
every group estimator, so it adds nothing to the gradient but dilutes the batch. Such groups are
dropped and more prompts are drawn until the step has ``prompts_per_step`` groups to train on.

``draw`` is the step's ``produce`` and the reward part of its ``score``:

- it draws batches of ``prompts_per_step`` prompts from the data cursor (each rank its shard,
  as a plain step does), samples and rewards their groups, and gathers every rank's groups in
  the global order of the data rule, so that every rank sees the same groups and decides alike;
- it stops once ``prompts_per_step`` groups with unequal rewards are kept (the first ones in
  draw order; the rest of the last batch is dropped, its items consumed all the same), or after
  ``algo.max_sample_batches`` batches: then it says so and the step trains on what it kept
  (nothing, when it kept no group: the step takes no optimizer step);
- the kept groups are dealt to the ranks again by the data rule (kept group j to rank
  j mod world), so the trained batch is an ordinary batch of ``kept`` items: its loss
  normalisers count only the kept groups, and it trains the same on any number of ranks. A rank
  that holds no kept group (fewer kept than ranks) carries one of its own drawn groups as
  padding, with no loss and outside the batch's layout, so that it can join the collective
  forwards.

The cursor moves by whole batches and only within the step, so a checkpoint (always at a step
boundary) holds it exactly and a resumed run draws the same batches. Sampling seeds come from
(run seed, step, the item's position among the step's draws): the first batch is sampled as a
plain step samples it.

Sampling ahead (``algo.max_off_policy_steps = k >= 1``), the producer draws step ``t + k``'s
batches while step ``t`` trains (``draw_ahead``, the producer's sampler: ``sample_ahead_with``),
by the same rule, the same cursor order and the same seeds, with the policy version of the
pipeline's schedule. To decide, it gathers every rank's per-group verdicts (rewards all equal
or not) over a process group of its own (``Collective.beside``, made once on every rank before
the first step), so its calls never meet the training thread's. It hands over this rank's
drawn batches in a row, rewarded; the step that trains them gathers every rank's groups and
keeps, deals and logs exactly as ``draw`` does (``taken``), so the sampling metrics are logged
with the step that trains the batch. A checkpoint holds those batches with their rewards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from runner.errors import Problem, RecipeError, RuntimeFailure
from runner.ranks.collective import Collective, interleave
from runner.rewards import RewardSet
from runner.rollout.base import Completion
from runner.train.assembly.run import RunContext
from runner.train.loops.pipeline import Produced
from runner.train.loops.rollouts import overlong_of, reward_trajectory, sample_ahead
from runner.train.loops.trajectory import Trajectory
from runner.types import ObsBundle


@attrs.frozen
class Group:
    """One prompt's group as plain data (it crosses ranks): the item's source index, and per
    completion its prompt ids, the completion, its reward and, for episodes, loss mask and env
    reward."""

    index: int
    prompt_ids: tuple[tuple[int, ...], ...]
    completions: tuple[Completion, ...]
    rewards: tuple[float, ...]
    loss_masks: tuple[tuple[int, ...], ...] = ()
    env_rewards: tuple[float, ...] = ()

    @property
    def informative(self) -> bool:
        """Its rewards are not all equal (its advantages are not all zero)."""
        return len(set(self.rewards)) > 1

    def to_plain(self) -> tuple[Any, ...]:
        return (self.index, [list(p) for p in self.prompt_ids],
                [[list(c.token_ids), c.text, list(c.logprobs), c.finish_reason,
                  list(c.segments)] for c in self.completions], list(self.rewards),
                [list(m) for m in self.loss_masks], list(self.env_rewards))

    @classmethod
    def from_plain(cls, raw: Sequence[Any]) -> Group:
        index, prompts, completions, rewards, masks, env = raw
        return cls(int(index), tuple(tuple(p) for p in prompts),
                   tuple(Completion(tuple(ids), text, tuple(lps), reason, tuple(segments))
                         for ids, text, lps, reason, segments in completions),
                   tuple(float(r) for r in rewards), tuple(tuple(m) for m in masks),
                   tuple(float(e) for e in env))


def groups_of(traj: Trajectory, indices: Sequence[int], size: int) -> list[Group]:
    """A rewarded trajectory's groups (``size`` adjacent completions each)."""
    out = []
    for start in range(0, len(traj.completions), size):
        part = slice(start, start + size)
        out.append(Group(indices[start], traj.prompt_ids[part], traj.completions[part],
                         traj.rewards[part], traj.loss_masks[part], traj.env_rewards[part]))
    return out


def trajectory_of(groups: Sequence[Group], item: Callable[[int], ObsBundle]) -> Trajectory:
    """The groups as one rewarded trajectory (prompt-major), their items read with ``item``."""
    items = {g.index: item(g.index) for g in groups}
    return Trajectory(
        tuple(items[g.index] for g in groups for _ in g.completions),
        tuple(p for g in groups for p in g.prompt_ids),
        tuple(c for g in groups for c in g.completions),
        rewards=tuple(r for g in groups for r in g.rewards),
        loss_masks=tuple(m for g in groups for m in g.loss_masks),
        env_rewards=tuple(e for g in groups for e in g.env_rewards), rewarded=True)


def joined(batches: Sequence[Trajectory]) -> Trajectory:
    """This rank's batches as one trajectory; its reward parts and episode numbers are the
    batches' means (every batch holds as many completions)."""
    def mean(dicts: Sequence[dict[str, float]]) -> dict[str, float]:
        keys = sorted({k for d in dicts for k in d})
        return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}

    return Trajectory(
        tuple(i for t in batches for i in t.items), tuple(p for t in batches for p in t.prompt_ids),
        tuple(c for t in batches for c in t.completions),
        rewards=tuple(r for t in batches for r in t.rewards),
        reward_parts=mean([t.reward_parts for t in batches]),
        loss_masks=tuple(m for t in batches for m in t.loss_masks),
        env_rewards=tuple(e for t in batches for e in t.env_rewards),
        env_stats=mean([t.env_stats for t in batches]),
        rewarded=all(t.rewarded for t in batches))


@attrs.frozen(eq=False)
class Drawn:
    """What ``draw`` hands to ``score``: this rank's share of the kept groups, rewarded (plus
    one padding group when it holds none), their number over every rank, everything this rank
    drew (for the step's reward and length metrics), every rank's drawn rewards, and the
    ``sampling/*`` metrics."""

    traj: Trajectory
    kept: int
    drawn: Trajectory
    drawn_rewards: list[float]
    metrics: dict[str, Any]


def draw_batch(run: RunContext, algo: Any, rewards: RewardSet, step: int, drawn: int
               ) -> tuple[Trajectory, list[int]]:
    """This rank's share of the step's batch number ``drawn`` (0: the first), sampled and
    rewarded, and the source index of each completion's item."""
    per_step = algo.prompts_per_step
    traj, indices = sample_ahead(run, per_step, algo.group_size, step, offset=drawn * per_step)
    return reward_trajectory(traj, rewards, step, overlong_of(run.svc.recipe)), indices


def draw(run: RunContext, algo: Any, rewards: RewardSet, step: int) -> Drawn:
    """The step's batches until ``algo.prompts_per_step`` groups with unequal rewards are kept
    or ``algo.max_sample_batches`` batches are drawn (see the module docstring)."""
    comm, per_step, size = run.svc.comm, algo.prompts_per_step, algo.group_size
    mine: list[Trajectory] = []  # this rank's batches, rewarded
    indices: list[int] = []  # their items' source indices, one per completion
    every: list[Group] = []  # every rank's groups, in the global draw order
    while len(mine) < algo.max_sample_batches and sum(g.informative for g in every) < per_step:
        traj, got = draw_batch(run, algo, rewards, step, len(mine))
        mine.append(traj)
        indices += got
        gathered = comm.gather([g.to_plain() for g in groups_of(traj, got, size)])
        every += [Group.from_plain(raw) for raw in interleave(gathered)]
    return decided(run, algo, step, joined(mine), indices, every)


def draw_ahead(run: RunContext, algo: Any, rewards: RewardSet, step: int, side: Collective
               ) -> tuple[Trajectory, list[int]]:
    """``draw``'s batches of step ``step``, drawn by the producer: every rank's verdicts (the
    groups with unequal rewards) gathered over ``side``, this rank's batches handed over in a
    row, rewarded, with their items' source indices (``taken`` decides the rest when the step
    trains). A rank whose draw fails tells the others, whose draws then fail too, naming it:
    no rank is left waiting in a gather."""
    per_step, size = algo.prompts_per_step, algo.group_size
    mine: list[Trajectory] = []
    indices: list[int] = []
    kept = 0
    while len(mine) < algo.max_sample_batches and kept < per_step:
        try:
            with torch.no_grad():  # (the grad mode is the thread's own)
                traj, got = draw_batch(run, algo, rewards, step, len(mine))
        except Exception:
            side.gather(None)  # the others' gather of this batch's verdicts gets this one
            raise
        verdicts = side.gather([g.informative for g in groups_of(traj, got, size)])
        failed = [r for r, v in enumerate(verdicts) if v is None]
        if failed:
            raise RuntimeFailure("producer", step, f"dynamic sampling's draw failed on rank "
                                 f"{failed[0]} (its own error says why)")
        mine.append(traj)
        indices += got
        kept += sum(sum(v) for v in verdicts)
    return joined(mine), indices


def sample_ahead_with(run: RunContext, algo: Any, rewards: RewardSet) -> None:
    """With a producer (sampling ahead), make it draw each step's batches by ``draw_ahead``,
    over a process group made here, on every rank at the same point before the first step."""
    producer = run.producer
    if producer is None:
        return
    side = run.svc.comm.beside(run.svc.recipe.launch.collective_timeout_s)
    producer.sample_with(lambda step: draw_ahead(run, algo, rewards, step, side))


def refuse_held(run: RunContext, algo: Any) -> None:
    """The batches a checkpoint holds in flight were drawn as this run draws: by dynamic
    sampling (their rewards kept) when it is on, by a plain producer when it is off (raises
    RecipeError naming ``algo.dynamic_sampling`` otherwise)."""
    on = algo.dynamic_sampling == "filter"
    held = list(run.producer.ahead) if run.producer is not None else []
    if run.state.ckpt is None or all(p.keeps_rewards == on for p in held):
        return
    raise RecipeError([Problem(
        "algo.dynamic_sampling", f"the checkpoint {run.state.ckpt.path.name} holds batches "
        f"sampled ahead {'without' if on else 'with'} dynamic sampling, which this run would "
        f"train {'with' if on else 'without'} it", got=algo.dynamic_sampling,
        hint="resume with the algo.dynamic_sampling that wrote it")])


def taken(run: RunContext, algo: Any, step: int, produced: Produced) -> Drawn:
    """What ``draw`` returns, from the batches the producer drew for step ``step``
    (``draw_ahead``): every rank's groups gathered here, in the global draw order."""
    size, per_step = algo.group_size, algo.prompts_per_step
    traj, indices = produced.traj, produced.indices
    local = [g.to_plain() for g in groups_of(traj, indices, size)]
    per_rank = run.svc.comm.gather(local)
    share = per_step // run.svc.rank.world_size  # each rank's groups of one batch
    every: list[Group] = []
    for start in range(0, len(local), share):
        batch = [groups[start:start + share] for groups in per_rank]
        every += [Group.from_plain(raw) for raw in interleave(batch)]
    return decided(run, algo, step, traj, indices, every)


def decided(run: RunContext, algo: Any, step: int, mine: Trajectory, indices: list[int],
            every: list[Group]) -> Drawn:
    """The step's kept groups, this rank's share of them and the step's sampling metrics, from
    this rank's drawn batches ``mine`` (in a row, rewarded; ``indices``: their items' source
    indices) and ``every`` rank's groups in the global draw order."""
    rank, per_step, size = run.svc.rank, algo.prompts_per_step, algo.group_size
    batches = len(every) // per_step
    local = groups_of(mine, indices, size)  # this rank's groups, in draw order
    items = {g.index: mine.items[k * size] for k, g in enumerate(local)}
    kept = [g for g in every if g.informative][:per_step]
    if len(kept) < per_step:
        run.svc.reporter.message(
            f"step {step}: dynamic sampling kept {len(kept)} of {per_step} groups in "
            f"{batches} batch(es) (algo.max_sample_batches); the step trains on those")
    # Padding (no loss, outside the layout) for a rank that holds no kept group: its own first.
    held = kept[rank.rank::rank.world_size] or local[:1]
    traj = trajectory_of(held, lambda i: items[i] if i in items
                         else run.state.data.source.item(i))
    consumed = [g.index for g in every]
    metrics: dict[str, Any] = {
        "sampling/filtered_frac": sum(not g.informative for g in every) / len(every),
        "sampling/extra_batches": float(batches - 1),
        "sampling/items_consumed": float(len(consumed)),
        "sampling/kept_groups": float(len(kept)),
        "data/items_consumed": consumed,
    }
    if run.svc.recipe.logging.item_ids:
        metrics["data/item_ids"] = [g.index for g in kept]
    return Drawn(traj, len(kept), mine, [r for g in every for r in g.rewards], metrics)
