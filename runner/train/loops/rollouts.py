"""Rollouts shared by GRPO, PPO and OPD: prompts -> packer -> engine -> scored trajectory."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch

from runner.envs.episodes import EpisodeResult, episode_stats
from runner.errors import RewardFailure
from runner.ranks.collective import interleave
from runner.recipe.schema import Recipe, RolloutConfig
from runner.rewards import RewardSet
from runner.rewards.calls import MAX_REWARD
from runner.rewards.shaping import Overlong
from runner.rollout.base import RolloutOutput, SamplingConfig
from runner.train.assembly.run import RunContext
from runner.train.assembly.seeds import item_seed
from runner.train.loops.batches import rank_mean
from runner.train.loops.pipeline import Produced
from runner.train.loops.trajectory import Trajectory
from runner.train.roles import Rollout
from runner.types import ObsBundle


def shared_prefix_lengths(token_lists: Sequence[Sequence[int]], group_size: int) -> list[int]:
    """For each sequence, the length of the token prefix its whole group shares (kept below the
    sequence's own length, so at least one token stays trained on).

    >>> shared_prefix_lengths([[1, 2, 3], [1, 2, 4], [5], [6, 7]], 2)
    [2, 2, 0, 0]
    """
    out = []
    for start in range(0, len(token_lists), group_size):
        group = [list(t) for t in token_lists[start:start + group_size]]
        common = 0
        while all(len(t) > common for t in group) and len({t[common] for t in group}) == 1:
            common += 1
        out += [max(0, min(common, len(t) - 1)) for t in group]
    return out


def shared_prefixes(traj: Trajectory, group_size: int) -> list[int]:
    """Shared-prefix lengths of the trajectory's groups, on the engine's own token ids (the
    positions the loss mask is laid on)."""
    return shared_prefix_lengths([c.token_ids for c in traj.completions], group_size)


def sampling(cfg: RolloutConfig, n: int, seed: int, *, greedy: bool = False) -> SamplingConfig:
    return SamplingConfig(n=n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k, seed=seed, greedy=greedy)


def trajectory(items: Sequence[ObsBundle], outputs: Sequence[RolloutOutput]) -> Trajectory:
    """Flatten the engine's outputs, prompt-major."""
    flat_items, flat_prompts, flat = [], [], []
    for item, out in zip(items, outputs, strict=True):
        for c in out.completions:
            flat_items.append(item)
            flat_prompts.append(out.prompt_ids)
            flat.append(c)
    return Trajectory(tuple(flat_items), tuple(flat_prompts), tuple(flat))


def episodes_trajectory(items: Sequence[ObsBundle], n: int,
                        results: Sequence[EpisodeResult]) -> Trajectory:
    """The trajectory of ``n`` played episodes per item (item-major)."""
    return Trajectory(tuple(item for item in items for _ in range(n)),
                      tuple(r.prompt_ids for r in results), tuple(r.completion for r in results),
                      loss_masks=tuple(r.loss_mask for r in results),
                      env_rewards=tuple(r.env_reward for r in results),
                      env_stats=episode_stats(results))


def roll_out(rollout: Rollout, items: Sequence[ObsBundle], params: SamplingConfig,
             seeds: Sequence[int] | None = None, step: int | None = None) -> Trajectory:
    """``params.n`` completions of each item: one reply each, or with ``[env]`` one played
    episode each."""
    if rollout.env is not None:
        return episodes_trajectory(items, params.n, rollout.play(items, params, seeds, step))
    return trajectory(items, rollout.generate(items, params, seeds))


def position_seeds(run: RunContext, seed: int, step: int, n: int, offset: int = 0) -> list[int]:
    """Seeds of this rank's ``n`` items of a batch, from each item's global position (rank r
    holds positions r, r + world, ...) plus ``offset`` (the step's items drawn before this
    batch): the same whatever the number of ranks."""
    world, rank = run.svc.rank.world_size, run.svc.rank.rank
    return [item_seed(seed, step, offset + j * world + rank) for j in range(n)]


def sample(run: RunContext, n_prompts: int, n_samples: int, step: int) -> Trajectory:
    """This rank's share of the step's ``n_prompts`` prompts from the global cursor, with
    ``n_samples`` completions each, seeded by each prompt's global position in the batch: the
    rollout every GRPO / PPO / OPD step starts with."""
    traj, indices = sample_ahead(run, n_prompts, n_samples, step)
    return with_item_ids(run, traj, indices, n_samples)


def sample_ahead(run: RunContext, n_prompts: int, n_samples: int, step: int, offset: int = 0
                 ) -> tuple[Trajectory, list[int]]:
    """``sample`` without any collective call (a producer thread runs it): the trajectory and
    the source index of each completion's item. ``offset``: the items the step drew before
    this batch (dynamic sampling's later batches), so that every draw has seeds of its own."""
    indexed = run.state.data.next_indexed(n_prompts // run.svc.rank.world_size)
    items = [item for _, item in indexed]
    seeds = position_seeds(run, run.svc.recipe.run.seed, step, len(items), offset)
    traj = roll_out(run.rollout, items, sampling(run.svc.recipe.rollout, n_samples, 0), seeds,
                    step)
    per_item = len(traj.completions) // max(1, len(items))
    return traj, [i for i, _ in indexed for _ in range(per_item)]


def with_item_ids(run: RunContext, traj: Trajectory, indices: Sequence[int], n_samples: int
                  ) -> Trajectory:
    """The step's global item ids on ``traj`` (with ``logging.item_ids``): gathered from every
    rank's ``indices`` (one per completion), as ``sample`` gathers them."""
    if not run.svc.recipe.logging.item_ids:
        return traj
    ids = interleave(run.svc.comm.gather(list(indices[::n_samples])))
    return attrs.evolve(traj, item_ids=tuple(ids))


def item_ids_metric(traj: Trajectory) -> dict[str, list[int]]:
    return {"data/item_ids": list(traj.item_ids)} if traj.item_ids else {}


Scored = TypeVar("Scored")
Drawn = TypeVar("Drawn")


def staged_step(run: RunContext, produce: Callable[[], Drawn],
                score: Callable[[Drawn], Scored],
                consume: Callable[[Scored], dict[str, Any]], scoring: str = "reward"
                ) -> tuple[Scored, dict[str, Any], dict[str, float]]:
    """A rollout step's three stages in a row, then the new weights to the engine: the scored
    batch, ``consume``'s metrics and the seconds of each stage (``scoring`` names the second:
    "reward", or "teacher" for OPD)."""
    t0 = time.perf_counter()
    traj = produce()
    t1 = time.perf_counter()
    scored = score(traj)
    t2 = time.perf_counter()
    metrics = consume(scored)
    t3 = time.perf_counter()
    run.sync_weights()
    t4 = time.perf_counter()
    return scored, metrics, {"rollout": t1 - t0, scoring: t2 - t1, "update": t3 - t2,
                             "sync": t4 - t3}


def staged_step_ahead(run: RunContext, step: int, n_samples: int,
                      score: Callable[[Drawn], Scored],
                      consume: Callable[[Scored], dict[str, Any]], scoring: str = "reward",
                      taken: Callable[[Produced], Drawn] | None = None
                      ) -> tuple[Scored, dict[str, Any], dict[str, float]]:
    """``staged_step`` with the batch sampled ahead (``algo.max_off_policy_steps = k``): the
    producer (``run.producer``) samples step ``step + k``'s batch (and, with a reward stage,
    rewards it) while this one is scored and trained; the new weights go to the engine once
    that batch is complete. ``score`` gets ``taken`` of the producer's batch (by default its
    trajectory with the step's item ids; dynamic sampling: ``dynamic.taken``), made in the
    scoring stage. The metrics include the batch's staleness; the seconds: the
    producer's sampling of this batch ("rollout"), the wait for it ("rollout_wait"), the
    scoring stage (``scoring``: the producer's rewarding of this batch, if it rewarded it,
    plus ``score`` here), update, the wait for the next ("producer_wait"), sync; with a reward
    stage also "reward_ahead", the producer's part of the scoring stage: spent beside the
    training when the producer thread sampled the batch, else by ``take`` on this thread (the
    first batches, those a checkpoint held: part of a "rollout_wait"). This thread's own
    seconds are "rollout_wait" + scoring - "reward_ahead" + update + "producer_wait" + sync."""
    from runner.train.loops.pipeline import staleness_metrics

    producer, k = run.producer, run.svc.recipe.algo.max_off_policy_steps
    t0 = time.perf_counter()
    produced = producer.take(step)
    if step + k <= run.svc.plan.max_steps:
        producer.start(step + k, version=step - 1)
    t1 = time.perf_counter()
    if taken is None:
        scored = score(with_item_ids(run, produced.traj, produced.indices, n_samples))
    else:
        scored = score(taken(produced))
    t2 = time.perf_counter()
    metrics = consume(scored) | staleness_metrics(run.svc.comm, produced, step, k)
    t3 = time.perf_counter()
    producer.wait()
    t4 = time.perf_counter()
    run.sync_weights()
    t5 = time.perf_counter()
    ahead = {"reward_ahead": produced.reward_seconds} if producer.reward is not None else {}
    return scored, metrics, {"rollout": produced.seconds, "rollout_wait": t1 - t0,
                             scoring: produced.reward_seconds + t2 - t1, **ahead,
                             "update": t3 - t2, "producer_wait": t4 - t3, "sync": t5 - t4}


def stages(run: RunContext, step: int, n_samples: int, produce: Callable[[], Drawn],
           score: Callable[[Drawn], Scored], consume: Callable[[Scored], dict[str, Any]],
           scoring: str = "reward", taken: Callable[[Produced], Drawn] | None = None
           ) -> tuple[Scored, dict[str, Any], dict[str, float]]:
    """A rollout step's stages: synchronous, or with its batch sampled ahead when the run has a
    producer (``algo.max_off_policy_steps >= 1``; ``taken``: what ``score`` gets of the
    producer's batch, see ``staged_step_ahead``); ``scoring`` names the second stage's time."""
    if run.producer is None:
        return staged_step(run, produce, score, consume, scoring)
    return staged_step_ahead(run, step, n_samples, score, consume, scoring, taken)


def step_metrics(run: RunContext, traj: Trajectory, rewards_all: Sequence[float],
                 seconds: Mapping[str, float], train_passes: int) -> dict[str, Any]:
    """The part of a step's metrics every rollout loop (GRPO, PPO, OPD) logs alike.

    ``reward/mean`` and ``reward/max`` over ``rewards_all`` (every rank's rewards), each reward
    function's mean (``reward/NAME``), ``completion_len`` (completion tokens per completion,
    over every rank), ``rollout/truncated_frac`` (the share of completions that hit the token
    limit unfinished, over every rank), the step's item ids (with ``logging.item_ids``),
    ``time/NAME`` for each phase in ``seconds`` (wall seconds; it must name "rollout" and
    "update"), and this rank's token throughput of the rollout and of the ``train_passes``
    passes the update made over its completions (``perf/rollout_tok_s``, ``perf/train_tok_s``).
    """
    r = torch.tensor(list(rewards_all))
    n_tokens, n_completions, n_truncated = run.svc.comm.sum(
        [traj.n_tokens, len(traj.completions), sum(traj.truncated)])
    return {
        "reward/mean": float(r.mean()), "reward/max": float(r.max()),
        **rank_mean(run.svc.comm, traj.reward_parts), "completion_len": n_tokens / n_completions,
        "rollout/truncated_frac": n_truncated / n_completions,
        **item_ids_metric(traj), **env_metrics(run, traj),
        **{f"time/{name}": s for name, s in seconds.items()},
        "perf/rollout_tok_s": traj.n_tokens / max(seconds["rollout"], 1e-9),
        "perf/train_tok_s": train_passes * traj.n_tokens / max(seconds["update"], 1e-9),
    }


def env_metrics(run: RunContext, traj: Trajectory) -> dict[str, float]:
    """The means over every rank's episodes of the episode numbers (``env/turns``, ...); none
    without ``[env]``. Every rank plays as many episodes, so the mean of means is the mean."""
    if not run.rollout or run.rollout.env is None:
        return {}
    per_rank = run.svc.comm.gather(dict(traj.env_stats))
    names = sorted({k for stats in per_rank for k in stats})
    return {k: sum(stats.get(k, 0.0) for stats in per_rank) / len(per_rank) for k in names}


def with_env_rewards(values: Sequence[float], traj: Trajectory, step: int | None = None
                     ) -> list[float]:
    """Each completion's reward functions' total plus its episode's env reward (if any); a sum
    beyond ``MAX_REWARD`` (each part is within it) is a ``RewardFailure`` naming both parts."""
    if not traj.env_rewards:
        return list(values)
    total = [v + e for v, e in zip(values, traj.env_rewards, strict=True)]
    bad = next((i for i, t in enumerate(total) if not abs(t) <= MAX_REWARD), None)
    if bad is not None:
        raise RewardFailure(step, [(
            "the reward functions' total plus the env reward", bad,
            f"is {total[bad]:g} at item {bad} ({values[bad]:g} + {traj.env_rewards[bad]:g}), "
            f"beyond the largest reward ({MAX_REWARD:g} in magnitude); scale the rewards down")])
    return total


def reward_trajectory(traj: Trajectory, rewards: RewardSet, step: int,
                      overlong: Overlong | None = None) -> Trajectory:
    """Rewards of ``traj``: the recipe's functions on each completion's text (an episode's last
    reply) plus, for episodes, the environment's reward (also logged as ``reward/env``), plus
    with ``overlong`` each completion's overlong penalty (its mean logged as
    ``reward/overlong_penalty``); the result is marked ``rewarded``. GRPO and PPO call it in
    their ``score``, or, sampling ahead, the producer right after sampling (with the same
    arguments: ``step`` is the batch's own)."""
    values, parts = rewards.score(traj.texts, traj.items, step=step)
    if traj.env_rewards:
        parts = {**parts, "reward/env": sum(traj.env_rewards) / len(traj.env_rewards)}
    total = with_env_rewards(values, traj, step)
    if overlong is not None:
        shaping = overlong.penalties([len(c.token_ids) for c in traj.completions])
        total = [t + s for t, s in zip(total, shaping, strict=True)]
        parts = {**parts, "reward/overlong_penalty": sum(shaping) / max(1, len(shaping))}
    return attrs.evolve(traj, rewards=tuple(total), reward_parts=parts, rewarded=True)


def rewarded(run: RunContext, rewards: RewardSet, traj: Trajectory, step: int) -> Trajectory:
    """Step ``step``'s batch with its rewards (and the overlong shaping): as it is when the
    reward stage already ran on it (the producer's, sampling ahead), else rewarded here. GRPO's
    and PPO's first scoring stage, and their producer's (``reward_ahead``): the same call."""
    if traj.rewarded:
        return traj
    return reward_trajectory(traj, rewards, step, overlong_of(run.svc.recipe))


def reward_ahead(run: RunContext, rewards: RewardSet) -> None:
    """With a producer (sampling ahead), give it the reward stage (``rewarded``): each batch is
    rewarded right after it is sampled."""
    if run.producer is not None:
        run.producer.reward_with(lambda traj, step: rewarded(run, rewards, traj, step))


def overlong_of(recipe: Recipe) -> Overlong | None:
    """The recipe's overlong reward shaping (``reward.overlong_buffer_len`` > 0), or None."""
    w = recipe.reward
    if not w.overlong_buffer_len:
        return None
    return Overlong(recipe.rollout.max_new_tokens, w.overlong_buffer_len, w.overlong_penalty)
