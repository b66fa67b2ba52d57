"""Read a TOML recipe, apply KEY=VALUE overrides, and build the frozen Recipe.

``load_recipe`` either returns a Recipe that passed every cross-field rule or raises
``RecipeError`` carrying every problem found, each with its key path.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from runner.errors import Problem, RecipeError
from runner.recipe.checks import check_recipe
from runner.recipe.converter import structure_recipe
from runner.recipe.schema import ALGO_KINDS, FREEFORM_KEYS, Recipe

OVERRIDE_SOURCE = "command line"
RESOLVED_TABLE = "resolved"  # informational table of recipe.resolved.toml, ignored on load


@attrs.frozen
class Override:
    key: str
    value: Any
    text: str


def parse_value(text: str) -> Any:
    """A TOML literal (``4``, ``true``, ``[1, 2]``, ``{a = 1}``, ``"s"``), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(items: Sequence[str]) -> tuple[list[Override], list[Problem]]:
    overrides, problems = [], []
    for text in items:
        key, sep, value = text.partition("=")
        key = key.strip().removeprefix("+")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(
                Problem(text, "not an override", hint="write KEY=VALUE, e.g. algo.group_size=4",
                        source=OVERRIDE_SOURCE)
            )
            continue
        overrides.append(Override(key, parse_value(value.strip()), text))
    return overrides, problems


def _schema_node(path: list[str], algo_kind: str) -> tuple[type | None, str]:
    """Walk the attrs classes along ``path``; returns (class or None, first unknown part)."""
    cls: Any = Recipe
    for i, part in enumerate(path):
        prefix = ".".join(path[:i + 1])
        if any(prefix == f or prefix.startswith(f + ".") for f in FREEFORM_KEYS):
            return None, ""
        if not attrs.has(cls):
            return cls, part
        names = {f.name: f for f in attrs.fields(cls)}
        if part not in names:
            return cls, part
        tp = names[part].type
        if cls is Recipe and part == "algo":
            tp = ALGO_KINDS.get(algo_kind, ALGO_KINDS["grpo"])
        cls = tp
    return None, ""


def apply_overrides(raw: dict[str, Any], overrides: Sequence[Override]) -> list[Problem]:
    """Set each override into ``raw`` (in place); returns problems for unknown or clashing keys."""
    problems: list[Problem] = []
    for ov in overrides:
        node = raw
        parts = ov.key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(Problem(ov.key, f"{part!r} is not a table", got=child,
                                        source=OVERRIDE_SOURCE))
                break
            node = child
        else:
            node[parts[-1]] = ov.value
    kind = raw.get("algo", {}).get("kind", "grpo") if isinstance(raw.get("algo"), dict) else "grpo"
    for ov in overrides:
        cls, unknown = _schema_node(ov.key.split("."), kind if isinstance(kind, str) else "grpo")
        if unknown and cls is not None and attrs.has(cls):
            valid = [f.name for f in attrs.fields(cls)]
            close = difflib.get_close_matches(unknown, valid, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "valid keys here: " + ", ".join(valid)
            problems.append(Problem(ov.key, f"unknown key {unknown!r} in override", hint=hint,
                                    source=OVERRIDE_SOURCE))
        elif unknown:
            problems.append(Problem(ov.key, f"{unknown!r} is below a plain value, not a table",
                                    source=OVERRIDE_SOURCE))
    return problems


def read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([Problem("", "recipe file not found", hint="check the path")],
                          source=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError([Problem("", f"cannot read the recipe: {exc}")], source=str(path)) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError([Problem("", f"not valid TOML: {exc}",
                                   hint="fix the syntax at that line")], source=str(path)) from None


def recipe_from_mapping(raw: Mapping[str, Any], source: str = "",
                        overrides: Sequence[str] = ()) -> Recipe:
    """Structure and check a recipe given as a mapping (the TOML document)."""
    raw = _deep_copy(raw)
    raw.pop(RESOLVED_TABLE, None)
    parsed, problems = parse_overrides(overrides)
    problems += apply_overrides(raw, parsed)
    if problems:
        raise RecipeError(problems, source=source)
    recipe, problems = structure_recipe(raw)
    if recipe is None:
        raise RecipeError(_mark_override_keys(problems, parsed), source=source)
    problems = check_recipe(recipe)
    if problems:
        raise RecipeError(_mark_override_keys(problems, parsed), source=source)
    return recipe


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    path = Path(path)
    return recipe_from_mapping(read_toml(path), source=str(path), overrides=overrides)


def _mark_override_keys(problems: list[Problem], overrides: Sequence[Override]) -> list[Problem]:
    given = {ov.key for ov in overrides}
    return [attrs.evolve(p, source=OVERRIDE_SOURCE) if p.key in given else p for p in problems]


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value
