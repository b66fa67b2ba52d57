"""Rewards: built-in and user callables ``(completions, items) -> list[float]``, combined by weight.

With ``reward.isolation = "thread"`` the functions of a set run concurrently in the trainer,
each under ``reward.timeout_s`` (``runner.rewards.calls``); any failure is a ``RewardFailure``
naming the function and the item. With ``"process"`` every sample of every function is a task
for the set's worker processes (``runner.rewards.pool``), each under its own limits; a failed
sample scores 0 and is counted (``reward.on_error = "zero"``) or stops the step (``"fail"``).
A reward model (``model:PATH``, ``runner.rewards.model``) always scores in the trainer, on its
device, like a thread-isolated function (or, under Ray's separate placement, in an actor of its
own that the trainer calls).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from runner.errors import Problem, RecipeError, RewardFailure
from runner.extensions import load_callable
from runner.recipe.reward_names import PREFIX as MODEL_PREFIX
from runner.recipe.reward_names import is_model_reward
from runner.recipe.schema import RewardConfig
from runner.rewards.builtin import (
    BUILTIN_REWARDS,
    arithmetic_exact,
    format_reward,
    math_verify_reward,
)
from runner.rewards.calls import MAX_REWARD, RewardFn, call_all
from runner.rewards.code_tests import code_rewards
from runner.rewards.model import ModelReward
from runner.rewards.sandbox import Limits
from runner.types import ObsBundle

if TYPE_CHECKING:
    from runner.rewards.pool import RewardPool

CODE_REWARDS = ("code_tests", "code_tests_all")  # they run the model's programs

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
    isolation: Literal["thread", "process"] = "thread"
    specs: tuple[str, ...] = ()  # what a worker process builds each function from
    workers: int = 1
    limits: Limits = Limits()
    on_error: Literal["zero", "fail"] = "zero"
    _pool: list[RewardPool] = attrs.field(factory=list, eq=False, repr=False, alias="_pool")

    def score(self, completions: Sequence[str], items: Sequence[ObsBundle], *,
              step: int | None = None) -> tuple[list[float], dict[str, float]]:
        """(weighted total per completion, ``{"reward/NAME": mean of NAME's values}``, with
        ``reward/failed/NAME``: the samples that failed, under process isolation)."""
        total, values_of, failed = self._scored(completions, items, step)
        parts = {f"reward/{name}": sum(values) / max(1, len(values))
                 for name, values in values_of.items()}
        return total, parts | {f"reward/failed/{name}": float(n) for name, n in failed.items()}

    def score_each(self, completions: Sequence[str], items: Sequence[ObsBundle], *,
                   step: int | None = None) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted total per completion, ``{NAME: NAME's value per completion}``)."""
        total, values_of, _ = self._scored(completions, items, step)
        return total, values_of

    def close(self) -> None:
        """End the worker processes (process isolation; they also end with the trainer)."""
        while self._pool:
            self._pool.pop().close()

    def _scored(self, completions: Sequence[str], items: Sequence[ObsBundle], step: int | None
                ) -> tuple[list[float], dict[str, list[float]], dict[str, int]]:
        failed: dict[str, int] = {}
        # Reward models score in this process; under process isolation the rest in the workers.
        here = [self.isolation == "thread" or is_model_reward(n) for n in self.names]
        pooled = [n for n, h in zip(self.names, here, strict=True) if not h]
        from_pool, failed = (self._in_workers(pooled, list(completions), list(items), step)
                             if pooled else ([], {}))
        local = call_all([n for n, h in zip(self.names, here, strict=True) if h],
                         [f for f, h in zip(self.functions, here, strict=True) if h],
                         list(completions), list(items), timeout_s=self.timeout_s, step=step) \
            if any(here) else []
        per_function = [(local if h else from_pool).pop(0) for h in here]
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
        return total, values_of, failed

    def _in_workers(self, names: list[str], completions: list[str], items: list[ObsBundle],
                    step: int | None) -> tuple[list[list[float]], dict[str, int]]:
        """Every sample of functions ``names`` in the worker processes; failures per
        ``on_error``."""
        from runner.rewards.pool import RewardPool

        if not self._pool:
            specs = dict(zip(self.names, self.specs, strict=True))
            self._pool.append(RewardPool({n: specs[n] for n in names}, self.workers,
                                         self.limits))
        values, failures = self._pool[0].score(names, completions, items)
        if failures and self.on_error == "fail":
            raise RewardFailure(step, [(f.name, f.index, f"at item {f.index}: {f.what}")
                                       for f in failures[:8]])
        counts = {name: sum(f.name == name for f in failures) for name in names}
        return [[0.0 if v is None else v for v in values[name]] for name in names], counts


def isolation_of(cfg: RewardConfig) -> Literal["thread", "process"]:
    """``reward.isolation``, or when it is empty: process for the code-running rewards."""
    if cfg.isolation:
        return cfg.isolation
    return "process" if set(cfg.functions) & set(CODE_REWARDS) else "thread"


def build_rewards(cfg: RewardConfig, *, device: Any = "cpu", dtype: str = "float32",
                  trust_remote_code: bool = False,
                  served: dict[str, RewardFn] | None = None) -> RewardSet:
    """The recipe's reward functions; reward models (``model:PATH``) load on ``device`` in
    ``dtype`` when first called, unless ``served`` has one for their ``reward.functions[i]`` key
    (a reward model in a Ray actor of its own)."""
    limits = Limits(cfg.sample_timeout_s, cfg.memory_mb)
    code = code_rewards(limits)

    def function(i: int, name: str) -> RewardFn:
        key = f"reward.functions[{i}]"
        if served and key in served:
            return served[key]
        if is_model_reward(name):
            return ModelReward(name[len(MODEL_PREFIX):], key, device=device, dtype=dtype,
                               trust_remote_code=trust_remote_code)
        return code.get(name) or BUILTIN_REWARDS.get(name) or load_callable(name, key=key)

    fns = tuple(function(i, n) for i, n in enumerate(cfg.functions))
    if "math_verify" in cfg.functions:
        _require_math_verify(cfg.functions.index("math_verify"))
    weights = tuple(cfg.weights) if cfg.weights else (1.0,) * len(fns)
    return RewardSet(tuple(cfg.functions), fns, weights, cfg.timeout_s,
                     isolation=isolation_of(cfg), specs=tuple(cfg.functions),
                     workers=cfg.workers or os.cpu_count() or 1, limits=limits,
                     on_error=cfg.on_error)


def _require_math_verify(index: int) -> None:
    try:
        import math_verify  # noqa: F401
    except ImportError as exc:
        raise RecipeError([Problem(f"reward.functions[{index}]", "the math_verify reward needs "
                                   f"the math-verify package, which cannot be imported ({exc})",
                                   got="math_verify", hint="install posttrain-runner with its "
                                   "dependencies, or pip install math-verify")]) from exc
