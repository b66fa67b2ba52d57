"""Pure loss and advantage functions of the algorithms (torch only, no engine).

Each loss takes its own attrs inputs class and its config slice and returns
``(loss, metrics)``. Each training loop imports its own algorithm's module directly; each
loop is named by its row of ``runner.recipe.algos.ALGORITHMS``.
"""

from __future__ import annotations

from runner.algorithms import dpo, grpo, opd, ppo, rm, sft

__all__ = ["dpo", "grpo", "opd", "ppo", "rm", "sft"]
