"""Read a TOML recipe, apply KEY=VALUE overrides, and build the frozen Recipe.

``load_recipe`` either returns a Recipe that passed every cross-field rule or raises
``RecipeError`` carrying every problem found, each with its key path.
"""

from __future__ import annotations

import difflib
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from runner.errors import Problem, RecipeError
from runner.recipe.checks import check_limits, check_recipe
from runner.recipe.converter import structure_recipe
from runner.recipe.schema import ALGO_KINDS, DEFAULT_KIND, FREEFORM_KEYS, Recipe

OVERRIDE_SOURCE = "command line"
RESOLVED_TABLE = "resolved"  # informational table of recipe.resolved.toml, ignored on load


@attrs.frozen
class Override:
    key: str
    value: Any
    text: str


class UnreadableValue(ValueError):
    """An override value that is valid TOML syntax but cannot be read (see ``toml_loads``)."""


def toml_loads(text: str) -> dict[str, Any]:
    """``tomllib.loads`` that fails only with ``TOMLDecodeError`` or ``UnreadableValue``.

    tomllib itself raises ``ValueError`` for an integer of more than Python's 4,300 digits and
    ``RecursionError`` for arrays or tables nested a few hundred deep. Both limits are process
    settings that an imported library may have raised (some lift the digit limit or the
    recursion limit when imported), so they are set to Python's defaults while reading.
    """
    digits, depth = sys.get_int_max_str_digits(), sys.getrecursionlimit()
    sys.set_int_max_str_digits(_MAX_INT_DIGITS)
    sys.setrecursionlimit(_RECURSION_LIMIT)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise
    except RecursionError:
        raise UnreadableValue("is nested too deeply to read") from None
    except ValueError as exc:
        if "digits" in str(exc):
            raise UnreadableValue("holds an integer too long to read (more than "
                                  f"{_MAX_INT_DIGITS} digits)") from None
        raise UnreadableValue(str(exc)) from None
    finally:
        sys.set_int_max_str_digits(digits)
        sys.setrecursionlimit(depth)


_MAX_INT_DIGITS = 4300  # Python's default
_RECURSION_LIMIT = 1000  # Python's default


def parse_value(text: str) -> Any:
    """A TOML literal (``4``, ``true``, ``[1, 2]``, ``{a = 1}``, ``"s"``), else the raw string.

    Raises ``UnreadableValue`` for a literal TOML accepts but Python cannot read.
    """
    try:
        return toml_loads(f"v = {text}")["v"]
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
        try:
            overrides.append(Override(key, parse_value(value.strip()), text))
        except UnreadableValue as exc:
            problems.append(Problem(key, f"the value {exc}", hint="give a plain TOML value",
                                    source=OVERRIDE_SOURCE))
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
            tp = ALGO_KINDS.get(algo_kind, ALGO_KINDS[DEFAULT_KIND])
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
    algo = raw.get("algo")
    kind = algo.get("kind", DEFAULT_KIND) if isinstance(algo, dict) else DEFAULT_KIND
    for ov in overrides:
        cls, unknown = _schema_node(ov.key.split("."),
                                    kind if isinstance(kind, str) else DEFAULT_KIND)
        if unknown and cls is not None and attrs.has(cls):
            valid = [f.name for f in attrs.fields(cls)]
            close = difflib.get_close_matches(unknown, valid, n=1)
            hint = (f"did you mean {close[0]!r}?" if close
                    else "valid keys here: " + ", ".join(valid))
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
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise RecipeError([Problem("", f"line {line}: not valid UTF-8 ({exc.reason})",
                                   hint="save the recipe as UTF-8")], source=str(path)) from None
    except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
        raise RecipeError([Problem("", f"cannot read the recipe: {exc}")],
                          source=str(path)) from None
    try:
        return toml_loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError([Problem("", f"not valid TOML: {exc}",
                                   hint="fix the syntax at that line")], source=str(path)) from None
    except UnreadableValue as exc:
        raise RecipeError([Problem("", f"the recipe {exc}", hint="give plain TOML values")],
                          source=str(path)) from None


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
    problems = check_recipe(recipe) + check_limits(recipe)
    if problems:
        raise RecipeError(_mark_override_keys(problems, parsed), source=source)
    return recipe


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    path = Path(path)
    return recipe_from_mapping(read_toml(path), source=str(path), overrides=overrides)


def _mark_override_keys(problems: list[Problem], overrides: Sequence[Override]) -> list[Problem]:
    given = {ov.key for ov in overrides}

    def from_override(key: str) -> bool:
        return key in given or any(key.startswith((g + ".", g + "[")) for g in given)

    return [attrs.evolve(p, source=OVERRIDE_SOURCE) if from_override(p.key) else p
            for p in problems]


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value
