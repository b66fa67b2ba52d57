"""Rollouts shared by GRPO, PPO and OPD: prompts -> packer -> engine -> scored trajectory."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from runner.packers.base import DataPacker, RLPolicyInput
from runner.recipe.schema import RolloutConfig
from runner.rewards import RewardSet
from runner.rewards.builtin import arithmetic_exact
from runner.rollout.base import Completion, RolloutEngine, RolloutOutput, SamplingConfig
from runner.types import ObsBundle


@attrs.frozen
class Trajectory:
    """``n`` completions for each prompt, flattened prompt-major (group members are adjacent)."""

    items: tuple[ObsBundle, ...]  # one per completion
    prompt_ids: tuple[tuple[int, ...], ...]  # one per completion
    completions: tuple[Completion, ...]
    rewards: tuple[float, ...] = ()
    reward_parts: dict[str, float] = attrs.field(factory=dict)

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]

    @property
    def n_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    def policy_inputs(self, packer: DataPacker, ignore_prefix: Sequence[int] | None = None
                      ) -> list[RLPolicyInput]:
        """Policy-side inputs; prompt ids come from the engine and are not re-tokenised.

        ``ignore_prefix[i]`` completion tokens at the start of sequence i are left out of the loss.
        """
        ignore = ignore_prefix or [0] * len(self.completions)
        return [packer.get_policy_input(item, c, n, prompt_ids=p)
                for item, c, p, n in zip(self.items, self.completions, self.prompt_ids, ignore, strict=True)]


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


def reward_side_prefixes(packer: DataPacker, traj: Trajectory, group_size: int) -> list[int]:
    """Shared-prefix lengths in token space, from the completions' text encoded by the
    reward-side packer (a fresh instance from the student's packer factory)."""
    tokens = [packer.encode_rollout_input(text) for text in traj.texts]
    return shared_prefix_lengths(tokens, group_size)


def sampling(cfg: RolloutConfig, n: int, seed: int, *, greedy: bool = False) -> SamplingConfig:
    return SamplingConfig(n=n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k, seed=seed, greedy=greedy)


def roll_out(engine: RolloutEngine, packer: DataPacker, items: Sequence[ObsBundle],
             params: SamplingConfig) -> Trajectory:
    prompts = [packer.encode_rollout_input(packer.get_rollout_input(item)) for item in items]
    outputs: list[RolloutOutput] = engine.generate(prompts, params)
    flat_items, flat_prompts, flat = [], [], []
    for item, out in zip(items, outputs, strict=True):
        for c in out.completions:
            flat_items.append(item)
            flat_prompts.append(out.prompt_ids)
            flat.append(c)
    return Trajectory(tuple(flat_items), tuple(flat_prompts), tuple(flat))


def score(traj: Trajectory, rewards: RewardSet, step: int) -> Trajectory:
    values, parts = rewards.score(traj.texts, traj.items, step=step)
    return attrs.evolve(traj, rewards=tuple(values), reward_parts=parts)


def evaluate(engine: RolloutEngine, packer: DataPacker, items: Sequence[ObsBundle],
             cfg: RolloutConfig, rewards: RewardSet | None, seed: int) -> dict[str, float]:
    """Greedy completions on the held-out items: exact accuracy (items with a reference) and
    mean reward under the run's reward functions."""
    traj = roll_out(engine, packer, items, sampling(cfg, 1, seed, greedy=True))
    metrics: dict[str, float] = {}
    with_ref = [(t, i) for t, i in zip(traj.texts, traj.items, strict=True) if str(i.reference)]
    if with_ref:
        texts, refs = zip(*with_ref, strict=True)
        metrics["eval/accuracy"] = sum(arithmetic_exact(texts, refs)) / len(with_ref)
    if rewards is not None:
        values, _ = rewards.score(traj.texts, traj.items)
        metrics["eval/reward"] = sum(values) / len(values)
    return metrics
