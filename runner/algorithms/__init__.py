"""Pure loss and advantage functions of the four algorithms (torch only, no engine).

Each loss takes its own attrs inputs class and its config slice and returns
``(loss, metrics)``. Each training loop imports its own algorithm's module directly; the one
dispatch table is ``runner.train.LOOPS``, keyed by ``recipe.algo.kind``.
"""

from __future__ import annotations

from runner.algorithms import dpo, grpo, opd, ppo

__all__ = ["dpo", "grpo", "opd", "ppo"]
