"""Rewards: built-in and user callables ``(completions, items) -> list[float]``, combined by weight.

The functions of a set run concurrently, each under ``reward.timeout_s`` (see
``runner.rewards.calls``); any failure is a ``RewardFailure`` naming the function and the item.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from runner.errors import Problem, RecipeError, RewardFailure
from runner.extensions import load_callable
from runner.recipe.schema import RewardConfig
from runner.rewards.builtin import (
    BUILTIN_REWARDS,
    arithmetic_exact,
    format_reward,
    math_verify_reward,
)
from runner.rewards.calls import MAX_REWARD, RewardFn, call_all
from runner.types import ObsBundle

__all__ = ["BUILTIN_REWARDS", "RewardSet", "arithmetic_exact", "build_rewards", "format_reward",
           "math_verify_reward"]


@attrs.frozen
class RewardSet:
    """Named reward functions and their weights; ``score`` returns the weighted sum per
    completion."""

    names: tuple[str, ...]
    functions: tuple[RewardFn, ...]
    weights: tuple[float, ...]
    timeout_s: float = 0.0

    def score(self, completions: Sequence[str], items: Sequence[ObsBundle], *,
              step: int | None = None) -> tuple[list[float], dict[str, float]]:
        """(weighted total per completion, ``{"reward/NAME": mean of NAME's values}``)."""
        total, values_of = self.score_each(completions, items, step=step)
        return total, {f"reward/{name}": sum(values) / max(1, len(values))
                       for name, values in values_of.items()}

    def score_each(self, completions: Sequence[str], items: Sequence[ObsBundle], *,
                   step: int | None = None) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted total per completion, ``{NAME: NAME's value per completion}``)."""
        per_function = call_all(self.names, self.functions, list(completions), list(items),
                                timeout_s=self.timeout_s, step=step)
        total = [0.0] * len(completions)
        values_of = {}
        for name, values, weight in zip(self.names, per_function, self.weights, strict=True):
            values_of[name] = [float(v) for v in values]
            total = [t + weight * v for t, v in zip(total, values, strict=True)]
        bad = next((i for i, t in enumerate(total) if not abs(t) <= MAX_REWARD), None)
        if bad is not None:
            raise RewardFailure(step, [("the weighted total (reward.weights)", bad,
                                        f"is {total[bad]:g} at item {bad}, beyond the largest "
                                        f"reward ({MAX_REWARD:g} in magnitude); lower "
                                        "reward.weights or the rewards' scale")])
        return total, values_of


def build_rewards(cfg: RewardConfig) -> RewardSet:
    fns = tuple(BUILTIN_REWARDS[n] if n in BUILTIN_REWARDS else
                load_callable(n, key=f"reward.functions[{i}]") for i, n in enumerate(cfg.functions))
    if "math_verify" in cfg.functions:
        _require_math_verify(cfg.functions.index("math_verify"))
    weights = tuple(cfg.weights) if cfg.weights else (1.0,) * len(fns)
    return RewardSet(tuple(cfg.functions), fns, weights, cfg.timeout_s)


def _require_math_verify(index: int) -> None:
    try:
        import math_verify  # noqa: F401
    except ImportError as exc:
        raise RecipeError([Problem(f"reward.functions[{index}]", "the math_verify reward needs "
                                   f"the math-verify package, which cannot be imported ({exc})",
                                   got="math_verify", hint="install posttrain-runner with its "
                                   "dependencies, or pip install math-verify")]) from exc
