"""Pure loss and advantage functions of the four algorithms (torch only, no engine).

Each loss takes its own attrs inputs class and its config slice and returns
``(loss, metrics)``; the engine picks one from ``LOSSES`` by ``recipe.algo.kind``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from runner.algorithms import dpo, grpo, opd, ppo

LossFn = Callable[[Any, Any], tuple[Tensor, dict[str, float]]]

LOSSES: dict[str, LossFn] = {
    "grpo": grpo.grpo_loss,
    "dpo": dpo.dpo_loss,
    "ppo": ppo.ppo_loss,
    "opd": opd.opd_loss,
}

__all__ = ["LOSSES", "LossFn", "dpo", "grpo", "opd", "ppo"]
