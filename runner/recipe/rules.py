"""Small pieces the recipe's rules share: whether a key is set, a range rule as a problem, and
whether a recipe plays multi-turn episodes. Below ``checks`` and the algorithm specs, so both
use them without importing each other."""

from __future__ import annotations

from runner.errors import Problem
from runner.recipe.schema import Recipe


def is_set(value: object) -> bool:
    """Whether a recipe value differs from "not given" (empty text, 0, an empty list or table)."""
    return value not in ("", 0, [], {}, None)


def in_range(key: str, value: float, ok: bool, rule: str) -> list[Problem]:
    """``[]`` when ``ok``, else one problem saying ``key`` must be ``rule``."""
    return [] if ok else [Problem(key, f"must be {rule}", got=value)]


def env_enabled(recipe: Recipe) -> bool:
    """Whether the recipe plays multi-turn episodes: an ``[env]`` factory, tools or an agent
    are named. The one place this is decided."""
    return bool(recipe.env.factory or recipe.env.tools or recipe.env.agent)
