"""The recipe: TOML -> frozen attrs config. Imports no torch."""

from runner.recipe.load import load_recipe, parse_overrides, recipe_from_mapping
from runner.recipe.plan import RunPlan, make_plan
from runner.recipe.schema import Recipe

__all__ = [
    "Recipe",
    "RunPlan",
    "load_recipe",
    "make_plan",
    "parse_overrides",
    "recipe_from_mapping",
]
