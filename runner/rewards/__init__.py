"""Rewards: built-in and user callables ``(completions, items) -> list[float]``, combined by weight."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs

from runner.errors import RuntimeFailure
from runner.extensions import load_callable
from runner.recipe.schema import RewardConfig
from runner.rewards.builtin import BUILTIN_REWARDS, arithmetic_exact, format_reward
from runner.types import ObsBundle

__all__ = ["BUILTIN_REWARDS", "RewardSet", "arithmetic_exact", "build_rewards", "format_reward"]

RewardFn = Callable[[Sequence[str], Sequence[ObsBundle]], Sequence[float]]


@attrs.frozen
class RewardSet:
    """Named reward functions and their weights; ``score`` returns the weighted sum per completion."""

    names: tuple[str, ...]
    functions: tuple[RewardFn, ...]
    weights: tuple[float, ...]

    def score(self, completions: Sequence[str], items: Sequence[ObsBundle], *, step: int | None = None
              ) -> tuple[list[float], dict[str, float]]:
        total = [0.0] * len(completions)
        parts = {}
        for name, fn, weight in zip(self.names, self.functions, self.weights, strict=True):
            values = _call(name, fn, completions, items, step)
            parts[f"reward/{name}"] = sum(values) / max(1, len(values))
            total = [t + weight * v for t, v in zip(total, values, strict=True)]
        return total, parts


def _call(name: str, fn: RewardFn, completions: Sequence[str], items: Sequence[ObsBundle],
          step: int | None) -> list[float]:
    try:
        values = list(fn(list(completions), list(items)))
    except Exception as exc:  # noqa: BLE001 - user rewards may raise anything
        raise RuntimeFailure("reward", step, f"{name} raised {type(exc).__name__}: {exc}") from exc
    if len(values) != len(completions):
        raise RuntimeFailure("reward", step, f"{name} returned {len(values)} values for "
                             f"{len(completions)} completions")
    out = []
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise RuntimeFailure("reward", step, f"{name} returned {value!r} at index {index}; "
                                 "rewards must be finite numbers")
        out.append(float(value))
    return out


def build_rewards(cfg: RewardConfig) -> RewardSet:
    fns = tuple(BUILTIN_REWARDS[n] if n in BUILTIN_REWARDS else
                load_callable(n, key=f"reward.functions[{i}]") for i, n in enumerate(cfg.functions))
    weights = tuple(cfg.weights) if cfg.weights else (1.0,) * len(fns)
    return RewardSet(tuple(cfg.functions), fns, weights)
