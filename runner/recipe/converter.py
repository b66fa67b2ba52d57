"""The one cattrs Converter of the project: strict types, no extra keys, every problem collected.

Problems come back as ``runner.errors.Problem`` objects whose ``key`` is the dotted key path.
"""

from __future__ import annotations

import difflib
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn

from runner.errors import Problem
from runner.recipe.schema import ALGO_KINDS, DEFAULT_KIND, AlgoConfig, Recipe


class _Invalid(Exception):
    """Raised by our hooks; carries problems whose keys are relative to the value's position."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(p.message for p in problems))
        self.problems = problems


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return "a table"
    if attrs.has(tp):
        return "a table"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _mismatch(tp: Any, value: Any) -> _Invalid:
    return _Invalid([Problem("", f"expected {_type_name(tp)}", got=value)])


# TOML integers are 64-bit signed; a value outside cannot be written back to
# recipe.resolved.toml by other tools, seeded, or used as a count.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
MAX_FREEFORM_DEPTH = 32  # nesting of arrays and tables inside a free-form table


def _value_problem(value: Any) -> Problem | None:
    """The generic rule every number of a recipe obeys: finite floats, 64-bit integers."""
    if isinstance(value, float) and not math.isfinite(value):
        return Problem("", "must be a finite number", got=value,
                       hint="inf and nan are not usable values")
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        return Problem("", "is outside the 64-bit integer range (-2**63 to 2**63 - 1)", got=value)
    return None


def _strict(tp: type, accept: tuple[type, ...], convert: Callable[[Any], Any]) -> Callable:
    def hook(value: Any, _: Any) -> Any:
        if isinstance(value, bool) and tp is not bool:
            raise _mismatch(tp, value)
        if not isinstance(value, accept):
            raise _mismatch(tp, value)
        problem = _value_problem(value)
        if problem is not None:
            raise _Invalid([problem])
        return convert(value)

    return hook


def _freeform_problems(value: Any, depth: int = 0) -> list[Problem]:
    """Problems of a free-form value (factory_kwargs): the generic number rules, bounded nesting."""
    if depth > MAX_FREEFORM_DEPTH:
        return [Problem("", f"is nested more than {MAX_FREEFORM_DEPTH} levels deep")]
    if isinstance(value, Mapping):
        return [_prefix(p, str(k)) for k, v in value.items()
                for p in _freeform_problems(v, depth + 1)]
    if isinstance(value, list | tuple):
        return [_prefix(p, f"[{i}]") for i, v in enumerate(value)
                for p in _freeform_problems(v, depth + 1)]
    problem = _value_problem(value)
    return [problem] if problem is not None else []


def _literal_hook(tp: Any) -> Callable:
    choices = typing.get_args(tp)

    def hook(value: Any, _: Any) -> Any:
        if value not in choices or isinstance(value, bool):
            raise _Invalid(
                [
                    Problem(
                        "",
                        "not a valid choice",
                        got=value,
                        hint="choose one of " + ", ".join(repr(c) for c in choices),
                    )
                ]
            )
        return value

    return hook


def _list_hook(conv: cattrs.Converter, tp: Any) -> Callable:
    (elem,) = typing.get_args(tp) or (Any,)

    def hook(value: Any, _: Any) -> list:
        if not isinstance(value, list):
            raise _mismatch(tp, value)
        out, problems = [], []
        for i, item in enumerate(value):
            try:
                out.append(conv.structure(item, elem))
            except _Invalid as exc:
                problems += [_prefix(p, f"[{i}]") for p in exc.problems]
        if problems:
            raise _Invalid(problems)
        return out

    return hook


def _dict_hook(value: Any, _: Any) -> dict:
    if not isinstance(value, Mapping):
        raise _mismatch(dict, value)
    problems = _freeform_problems(value)
    if problems:
        raise _Invalid(problems)
    return dict(value)


def _prefix(problem: Problem, name: str) -> Problem:
    if not name:
        return problem
    if problem.key.startswith("["):
        key = name + problem.key
    else:
        key = f"{name}.{problem.key}" if problem.key else name
    return attrs.evolve(problem, key=key)


def _unknown_key_problem(cls: type, extra: str) -> Problem:
    valid = [f.name for f in attrs.fields(cls)]
    close = difflib.get_close_matches(extra, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else "valid keys: " + ", ".join(valid)
    return Problem(extra, f"unknown key in {_table_label(cls)}", hint=hint)


def _table_labels() -> dict[type, str]:
    labels: dict[type, str] = {Recipe: "the recipe"}
    for field in attrs.fields(Recipe):
        if attrs.has(field.type):
            labels[field.type] = f"[{field.name}]"
            for sub in attrs.fields(field.type):
                if attrs.has(sub.type):
                    labels[sub.type] = f"[{field.name}.{sub.name}]"
    for kind, cls in ALGO_KINDS.items():
        labels[cls] = f"[algo] for kind = {kind!r}"
    return labels


def _table_label(cls: type) -> str:
    return _TABLE_LABELS.get(cls, cls.__name__)


def _flatten(exc: BaseException, cls: type) -> list[Problem]:
    """Turn a cattrs ClassValidationError tree (with our _Invalid leaves) into Problems."""
    if isinstance(exc, _Invalid):
        return exc.problems
    if isinstance(exc, ForbiddenExtraKeysError):
        return [_unknown_key_problem(exc.cl, extra) for extra in sorted(exc.extra_fields)]
    if isinstance(exc, BaseExceptionGroup):
        problems: list[Problem] = []
        for sub in exc.exceptions:
            name = ""
            for note in getattr(sub, "__notes__", []):
                if hasattr(note, "name"):
                    name = note.name
            problems += [_prefix(p, name) for p in _flatten(sub, cls)]
        return problems
    return [Problem("", f"invalid value: {exc}")]


def _attrs_hook_factory(conv: cattrs.Converter) -> Callable[[type], Callable]:
    def factory(cls: type) -> Callable:
        inner = make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True)

        def hook(value: Any, _: Any) -> Any:
            if not isinstance(value, Mapping):
                raise _mismatch(cls, value)
            try:
                return inner(value, cls)
            except (cattrs.BaseValidationError, ForbiddenExtraKeysError) as exc:
                raise _Invalid(_flatten(exc, cls)) from None

        return hook

    return factory


def _algo_hook(conv: cattrs.Converter) -> Callable:
    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, Mapping):
            raise _mismatch(dict, value)
        kind = value.get("kind", DEFAULT_KIND)
        cls = ALGO_KINDS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise _Invalid(
                [
                    Problem(
                        "kind",
                        "unknown algorithm kind",
                        got=kind,
                        hint="valid kinds: " + ", ".join(ALGO_KINDS),
                    )
                ]
            )
        return conv.structure(dict(value, kind=kind), cls)

    return hook


def make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _strict(int, (int,), int))
    conv.register_structure_hook(float, _strict(float, (int, float), float))
    conv.register_structure_hook(str, _strict(str, (str,), str))
    conv.register_structure_hook(bool, _strict(bool, (bool,), bool))
    conv.register_structure_hook(Any, lambda v, _: v)
    conv.register_structure_hook_factory(
        lambda t: typing.get_origin(t) is Literal, _literal_hook
    )
    conv.register_structure_hook_factory(
        lambda t: typing.get_origin(t) is list, lambda t: _list_hook(conv, t)
    )
    conv.register_structure_hook_factory(
        lambda t: typing.get_origin(t) is dict, lambda t: _dict_hook
    )
    conv.register_structure_hook(AlgoConfig, _algo_hook(conv))
    conv.register_structure_hook_factory(attrs.has, _attrs_hook_factory(conv))
    return conv


CONVERTER = make_converter()
_TABLE_LABELS = _table_labels()


def structure_recipe(raw: Mapping[str, Any]) -> tuple[Recipe | None, list[Problem]]:
    """Build a Recipe from a plain mapping; returns (recipe, []) or (None, problems)."""
    try:
        return CONVERTER.structure(raw, Recipe), []
    except _Invalid as exc:
        return None, exc.problems


def unstructure_recipe(recipe: Recipe) -> dict[str, Any]:
    return CONVERTER.unstructure(recipe)
