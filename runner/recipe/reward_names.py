"""How ``reward.functions`` names a trained reward model: ``model:PATH``.

Only the names are read here; loading and scoring live in ``runner.rewards.model``.
"""

from __future__ import annotations

from collections.abc import Sequence

PREFIX = "model:"


def is_model_reward(name: str) -> bool:
    return name.startswith(PREFIX)


def model_rewards(functions: Sequence[str]) -> list[tuple[str, str]]:
    """(recipe key, path) of each reward model among ``reward.functions``.

    >>> model_rewards(["arithmetic_exact", "model:runs/rm"])
    [('reward.functions[1]', 'runs/rm')]
    """
    return [(f"reward.functions[{i}]", name[len(PREFIX):]) for i, name in enumerate(functions)
            if is_model_reward(name)]
