"""Held-out evaluation: the recipe's held-out prompts generated with ``[eval]``'s sampling
and scored by its reward functions (``generate_held_out``), each prompt's pass@k and maj@n
(``prompt_passes``), and the ``eval/*`` metrics a run logs at its evaluations (``evaluate``).
The eval command (``runner.eval.rank``) generates and scores its prompts with the same
functions."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from runner.recipe.schema import Recipe
from runner.rewards import RewardSet
from runner.rewards.passk import ANSWER_OF, majority_passes, pass_at_k, pass_function, pass_ks
from runner.rollout.base import SamplingConfig
from runner.train.assembly.run import RunContext
from runner.train.assembly.seeds import item_seed
from runner.train.loops.rollouts import episodes_trajectory, roll_out, sampling, with_env_rewards
from runner.train.roles import Rollout
from runner.types import ObsBundle


@attrs.frozen
class HeldOut:
    """This rank's held-out prompts with their completions (``n`` per prompt, prompt-major),
    scored by the recipe's reward functions."""

    items: list[ObsBundle]
    texts: list[str]
    totals: list[float]  # the weighted total per completion
    values_of: dict[str, list[float]]  # each function's value (and "env") per completion
    n: int
    env_stats: dict[str, float] = attrs.field(factory=dict)  # episode means, with [env]
    episodes: list[dict[str, float]] = attrs.field(factory=list)  # each episode's numbers

    def of_item(self, i: int) -> slice:
        return slice(i * self.n, (i + 1) * self.n)


def held_out_sampling(recipe: Recipe) -> SamplingConfig:
    """``[eval]``'s sampling: greedy, one completion per prompt, by default."""
    cfg, rollout = recipe.eval, recipe.rollout
    greedy = cfg.temperature == 0
    return attrs.evolve(sampling(rollout, 1 if greedy else cfg.num_samples, 0, greedy=greedy),
                        max_new_tokens=cfg.max_new_tokens or rollout.max_new_tokens,
                        temperature=cfg.temperature if not greedy else 1.0)


def generate_held_out(rollout: Rollout, recipe: Recipe, items: Sequence[ObsBundle],
                      rewards: RewardSet, rank: int, world: int, first: int = 0) -> HeldOut:
    """Completions of this rank's held-out ``items`` (rank r holds positions r, r + world, ...;
    ``items`` starts at this rank's ``first``-th), seeded by each prompt's global position, and
    their rewards."""
    params = held_out_sampling(recipe)
    seeds = [item_seed(recipe.run.seed, 0, j * world + rank)
             for j in range(first, first + len(items))]
    episodes: list[dict[str, float]] = []
    if rollout.env is not None:
        results = rollout.play(items, params, seeds)
        traj = episodes_trajectory(items, params.n, results)
        episodes = [dict(r.stats) for r in results]
    else:
        traj = roll_out(rollout, items, params, seeds)
    totals, values_of = rewards.score_each(traj.texts, traj.items)
    if traj.env_rewards:
        values_of = {**values_of, "env": list(traj.env_rewards)}
    return HeldOut(list(items), list(traj.texts), with_env_rewards(totals, traj), values_of,
                   params.n, dict(traj.env_stats), episodes)


def pass_names(recipe: Recipe) -> list[str]:
    """The pass metrics of ``[eval]`` (pass@k for every k, maj@n where the pass function has
    answers to vote on), in order; with one completion per prompt (greedy) pass@1 alone; none
    without a pass function."""
    cfg = recipe.eval
    fn = pass_function(recipe.reward, cfg)
    n = 1 if cfg.temperature == 0 else cfg.num_samples
    if not fn:
        return []
    if n < 2:
        return ["pass@1"]
    return [f"pass@{k}" for k in pass_ks(cfg)] + ([f"maj@{n}"] if fn in ANSWER_OF else [])


def prompt_passes(recipe: Recipe, held: HeldOut, i: int) -> tuple[list[bool], dict[str, float]]:
    """Prompt ``i``'s completions that pass, and its pass@k and maj@n (``pass_names``) from
    them."""
    cfg = recipe.eval
    fn = pass_function(recipe.reward, cfg)
    texts = held.texts[held.of_item(i)]
    passed = [v >= cfg.pass_threshold for v in held.values_of[fn][held.of_item(i)]]
    out = {f"pass@{k}": pass_at_k(len(passed), sum(passed), k) for k in pass_ks(cfg)}
    if fn in ANSWER_OF:
        out[f"maj@{len(passed)}"] = float(majority_passes(texts, passed, ANSWER_OF[fn]))
    return passed, out


def evaluate(run: RunContext, rewards: RewardSet) -> dict[str, float]:
    """Held-out completions (``[eval]``: greedy by default) scored by the recipe's own reward
    functions, each rank its shard, sums over ranks: ``eval/reward`` (the weighted total) and
    ``eval/reward/NAME`` per function, means over every completion; with several completions
    per prompt also ``eval/pass@k`` and ``eval/maj@n`` (greedy: ``eval/pass@1``), means over the
    prompts."""
    recipe, items = run.svc.recipe, run.state.val_items
    total, parts = [], {f"reward/{n}": 0.0 for n in rewards.names}
    playing = run.rollout is not None and run.rollout.env is not None
    if playing:
        parts["reward/env"] = 0.0
    passing = dict.fromkeys(pass_names(recipe), 0.0)
    held = None
    if items:
        held = generate_held_out(run.rollout, recipe, items, rewards, run.svc.rank.rank,
                                 run.svc.rank.world_size)
        total = held.totals
        parts = {f"reward/{k}": (sum(v) / max(1, len(v))) * len(total)  # means -> sums
                 for k, v in held.values_of.items()}
        for i in range(len(items) if passing else 0):
            for name, value in prompt_passes(recipe, held, i)[1].items():
                if name in passing:  # greedy: pass@1 alone (maj@1 says nothing more)
                    passing[name] += value
    names, pass_keys = sorted(parts), list(passing)
    sums = run.svc.comm.sum([float(sum(total)), float(len(total)), float(len(items)),
                             *(parts[k] for k in names), *(passing[k] for k in pass_keys)])
    n, prompts = max(1.0, sums[1]), max(1.0, sums[2])
    means = [v / n for v in sums[3:3 + len(names)]]
    episodes = (_weighted_means(run, len(total), held.env_stats if held else {}, "eval/")
                if playing else {})
    return {"eval/reward": sums[0] / n, **episodes, **{f"eval/{k}": v for k, v in zip(names, means,
                                                                          strict=True)},
            **{f"eval/{k}": v / prompts for k, v in zip(pass_keys, sums[3 + len(names):],
                                                          strict=True)}}


def _weighted_means(run: RunContext, count: int, means: dict[str, float], prefix: str
                    ) -> dict[str, float]:
    """Per-key means over every rank's ``count`` items of each rank's ``means``."""
    per_rank = run.svc.comm.gather([count, dict(means)])
    total = sum(c for c, _ in per_rank)
    names = sorted({k for _, m in per_rank for k in m})
    return {prefix + k: sum(c * m.get(k, 0.0) for c, m in per_rank) / max(1, total)
            for k in names}
