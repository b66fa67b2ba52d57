"""A trajectory: the prompts of a step, the completions the engine sampled for them (tokens
and logprobs) and, once scored, their rewards. What ``produce`` hands to ``score``."""

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
                for item, c, p, n in zip(self.items, self.completions, self.prompt_ids, ignore,
                                         strict=True)]
