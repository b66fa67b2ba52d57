"""Rollouts shared by GRPO, PPO and OPD: prompts -> packer -> engine -> scored trajectory."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch

from runner.ranks.collective import interleave
from runner.recipe.schema import RolloutConfig
from runner.rewards import RewardSet
from runner.rollout.base import RolloutOutput, SamplingConfig
from runner.train.assemble import RunContext
from runner.train.batches import rank_mean
from runner.train.roles import Rollout
from runner.train.seeds import item_seed
from runner.train.trajectory import Trajectory
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


def roll_out(rollout: Rollout, items: Sequence[ObsBundle], params: SamplingConfig,
             seeds: Sequence[int] | None = None) -> Trajectory:
    return trajectory(items, rollout.generate(items, params, seeds))


def position_seeds(run: RunContext, seed: int, step: int, n: int) -> list[int]:
    """Seeds of this rank's ``n`` items of a batch, from each item's global position (rank r
    holds positions r, r + world, ...): the same whatever the number of ranks."""
    world, rank = run.svc.rank.world_size, run.svc.rank.rank
    return [item_seed(seed, step, j * world + rank) for j in range(n)]


def sample(run: RunContext, n_prompts: int, n_samples: int, step: int) -> Trajectory:
    """This rank's share of the step's ``n_prompts`` prompts from the global cursor, with
    ``n_samples`` completions each, seeded by each prompt's global position in the batch: the
    rollout every GRPO / PPO / OPD step starts with."""
    indexed = run.state.data.next_indexed(n_prompts // run.svc.rank.world_size)
    items = [item for _, item in indexed]
    seeds = position_seeds(run, run.svc.recipe.run.seed, step, len(items))
    traj = roll_out(run.rollout, items, sampling(run.svc.recipe.rollout, n_samples, 0), seeds)
    if run.svc.recipe.logging.item_ids:
        ids = interleave(run.svc.comm.gather([i for i, _ in indexed]))
        traj = attrs.evolve(traj, item_ids=tuple(ids))
    return traj


def item_ids_metric(traj: Trajectory) -> dict[str, list[int]]:
    return {"data/item_ids": list(traj.item_ids)} if traj.item_ids else {}


Scored = TypeVar("Scored")


def staged_step(run: RunContext, produce: Callable[[], Trajectory],
                score: Callable[[Trajectory], Scored],
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


def step_metrics(run: RunContext, traj: Trajectory, rewards_all: Sequence[float],
                 seconds: Mapping[str, float], train_passes: int) -> dict[str, Any]:
    """The part of a step's metrics every rollout loop (GRPO, PPO, OPD) logs alike.

    ``reward/mean`` and ``reward/max`` over ``rewards_all`` (every rank's rewards), each reward
    function's mean (``reward/NAME``), ``completion_len`` (completion tokens per completion,
    over every rank), the step's item ids (with ``logging.item_ids``), ``time/NAME`` for each
    phase in ``seconds`` (wall seconds; it must name "rollout" and "update"), and this rank's
    token throughput of the rollout and of the ``train_passes`` passes the update made over its
    completions (``perf/rollout_tok_s``, ``perf/train_tok_s``).
    """
    r = torch.tensor(list(rewards_all))
    n_tokens, n_completions = run.svc.comm.sum([traj.n_tokens, len(traj.completions)])
    return {
        "reward/mean": float(r.mean()), "reward/max": float(r.max()),
        **rank_mean(run.svc.comm, traj.reward_parts), "completion_len": n_tokens / n_completions,
        **item_ids_metric(traj), **{f"time/{name}": s for name, s in seconds.items()},
        "perf/rollout_tok_s": traj.n_tokens / max(seconds["rollout"], 1e-9),
        "perf/train_tok_s": train_passes * traj.n_tokens / max(seconds["update"], 1e-9),
    }


def score(traj: Trajectory, rewards: RewardSet, step: int) -> Trajectory:
    values, parts = rewards.score(traj.texts, traj.items, step=step)
    return attrs.evolve(traj, rewards=tuple(values), reward_parts=parts)


def evaluate(run: RunContext, rewards: RewardSet) -> dict[str, float]:
    """Held-out completions (``[eval]``: greedy by default) scored by the recipe's own reward
    functions, each rank its shard, sums over ranks: ``eval/reward`` (the weighted total) and
    ``eval/reward/NAME`` per function, means over every completion."""
    cfg, items = run.svc.recipe.eval, run.state.val_items
    total, parts = [], {f"reward/{n}": 0.0 for n in rewards.names}
    if items:
        greedy = cfg.temperature == 0
        rollout = run.svc.recipe.rollout
        params = attrs.evolve(sampling(rollout, 1 if greedy else cfg.num_samples, 0,
                                       greedy=greedy),
                              max_new_tokens=cfg.max_new_tokens or rollout.max_new_tokens,
                              temperature=cfg.temperature if not greedy else 1.0)
        seeds = position_seeds(run, run.svc.recipe.run.seed, 0, len(items))
        traj = roll_out(run.rollout, items, params, seeds)
        total, means = rewards.score(traj.texts, traj.items)
        parts = {k: v * len(total) for k, v in means.items()}  # means -> sums
    names = sorted(parts)
    sums = run.svc.comm.sum([float(sum(total)), float(len(total)), *(parts[k] for k in names)])
    n = max(1.0, sums[1])
    return {"eval/reward": sums[0] / n, **{f"eval/{k}": v / n for k, v in zip(names, sums[2:],
                                                                          strict=True)}}
