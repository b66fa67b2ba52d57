"""``--validate``: import every dotted path of a recipe and check it can be called as configured.

Nothing is constructed here (no dataset, no packer): construction belongs to the owning role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runner.errors import ExtensionError, Problem
from runner.extensions import check_binds, load_callable
from runner.recipe.checks import BUILTIN_REWARDS
from runner.recipe.schema import Recipe


def _calls(recipe: Recipe) -> list[tuple[str, str, tuple, dict[str, Any]]]:
    """(key, dotted path, positional args, keyword args) of every configured extension call."""
    d, p = recipe.data, recipe.data_packer
    calls = [
        ("data.factory", d.factory, (), d.factory_kwargs),
        ("data.items_fn", d.items_fn, ({},), {}),
        ("data.validation.factory", d.validation.factory, (), d.validation.factory_kwargs),
        ("data_packer.factory", p.factory, (), {}),
        ("data_packer.teacher_model_factory", p.teacher_model_factory, (), {}),
    ]
    calls += [
        (f"reward.functions[{i}]", fn, ([], []), {})
        for i, fn in enumerate(recipe.reward.functions)
        if fn not in BUILTIN_REWARDS and recipe.algo.kind in ("grpo", "ppo")
    ]
    return [c for c in calls if c[1]]


def validate_models(recipe: Recipe) -> list[Problem]:
    """Model-level checks that need the model folders (built-in models are built once, cached):
    OPD same_tokenizer needs one vocabulary for student and teacher."""
    if recipe.algo.kind != "opd" or recipe.algo.mode != "same_tokenizer":
        return []
    from runner.errors import RecipeError
    from runner.models import resolve_model_path
    from runner.train.opd import check_same_vocab

    try:
        check_same_vocab(resolve_model_path(recipe.model.path), resolve_model_path(recipe.algo.teacher_path))
    except RecipeError as exc:
        return list(exc.problems)
    return []


def validate_extensions(recipe: Recipe) -> list[Problem]:
    """Every problem with the recipe's extensions (all are checked, none stops the others)."""
    problems: list[Problem] = []
    for key, dotted, args, kwargs in _calls(recipe):
        try:
            fn: Callable[..., Any] = load_callable(dotted, key=key)
            check_binds(fn, dotted, key=key, args=args, kwargs=kwargs)
        except ExtensionError as exc:
            problems += exc.problems
    return problems
