"""A trajectory: the prompts of a step, the completions the engine sampled for them (tokens
and logprobs) and, once rewarded, their rewards. What ``produce`` hands to ``score`` (already
rewarded when a producer sampled it ahead: ``rewarded``)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from runner.packers.base import DataPacker, RLPolicyInput
from runner.rollout.base import Completion
from runner.types import ObsBundle


@attrs.frozen
class Trajectory:
    """``n`` completions for each prompt, flattened prompt-major (group members are adjacent)."""

    items: tuple[ObsBundle, ...]  # one per completion
    prompt_ids: tuple[tuple[int, ...], ...]  # one per completion
    completions: tuple[Completion, ...]
    rewards: tuple[float, ...] = ()
    reward_parts: dict[str, float] = attrs.field(factory=dict)
    item_ids: tuple[int, ...] = ()  # the step's global item ids, with logging.item_ids
    # Multi-turn episodes ([env]): per completion, 1 on the engine's tokens and 0 on the
    # environment's (never trained); each episode's env reward (the sum of its turns'); this
    # rank's means of the episode numbers (env/turns, env/tool_calls, ...). Empty otherwise.
    loss_masks: tuple[tuple[int, ...], ...] = ()
    env_rewards: tuple[float, ...] = ()
    env_stats: dict[str, float] = attrs.field(factory=dict)
    # The reward stage ran on it (``rollouts.reward_trajectory``): ``rewards`` and
    # ``reward_parts`` are final, and a loop's ``score`` does not reward it again. A producer
    # that samples ahead rewards its batches itself; a batch read back from a checkpoint comes
    # without rewards (False) and is rewarded on the training thread (``Producer.take``).
    rewarded: bool = False

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]

    @property
    def truncated(self) -> tuple[bool, ...]:
        """Per completion: it hit the token limit without finishing (an episode: its last
        reply did)."""
        return tuple(c.finish_reason == "length" for c in self.completions)

    @property
    def n_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    def policy_inputs(self, packer: DataPacker, ignore_prefix: Sequence[int] | None = None
                      ) -> list[RLPolicyInput]:
        """Policy-side inputs; prompt ids come from the engine and are not re-tokenised.

        ``ignore_prefix[i]`` completion tokens at the start of sequence i are left out of the loss.
        """
        ignore = ignore_prefix or [0] * len(self.completions)
        inputs = [packer.get_policy_input(item, c, n, prompt_ids=p)
                  for item, c, p, n in zip(self.items, self.completions, self.prompt_ids, ignore,
                                           strict=True)]
        if not self.loss_masks:
            return inputs
        return [_episode_mask(x, c, m, packer)
                for x, c, m in zip(inputs, self.completions, self.loss_masks, strict=True)]


def _episode_mask(x: RLPolicyInput, c: Completion, mask: Sequence[int], packer: DataPacker
                  ) -> RLPolicyInput:
    """``x`` with the environment's tokens out of the loss. The packer must have kept the
    episode's tokens as they are: the mask is laid on them position by position."""
    if x.completion_ids != tuple(c.token_ids):
        raise ValueError(f"{type(packer).__name__}.get_policy_input changed an episode's tokens "
                         f"({len(c.token_ids)} -> {len(x.completion_ids)}); [env] needs them kept "
                         "as the engine and the chat template wrote them")
    n = x.n_prompt_tokens
    loss = x.loss_mask[:n] + tuple(a * b for a, b in zip(x.loss_mask[n:], mask, strict=True))
    return attrs.evolve(x, loss_mask=loss, segments=tuple(n + s for s in c.segments))


def without_loss(inputs: Sequence[RLPolicyInput], drop: Sequence[bool]) -> list[RLPolicyInput]:
    """``inputs`` with the loss mask of every ``drop``-ped sequence cleared: those carry no
    loss (``algo.mask_truncated``)."""
    return [attrs.evolve(x, loss_mask=(0,) * len(x.loss_mask)) if d else x
            for x, d in zip(inputs, drop, strict=True)]
