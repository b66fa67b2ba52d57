"""Generate schemas/recipe.schema.json from the attrs classes of ``runner.recipe.schema``.

Run ``python -m runner.recipe.jsonschema`` (or ``make schema``) after changing the schema;
a test fails while the file is out of date.
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import attrs

from runner.recipe.schema import ALGO_KINDS, Recipe

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "recipe.schema.json"
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _type_schema(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = list(typing.get_args(tp))
        return {"type": "string", "enum": choices} if len(choices) > 1 else {"const": choices[0]}
    if origin is list:
        return {"type": "array", "items": _type_schema(typing.get_args(tp)[0])}
    if origin is dict:
        return {"type": "object"}
    if attrs.has(tp):
        return _class_schema(tp)
    if tp is Any:
        return {}
    return {"type": _JSON_TYPES[tp]}


def _default(field: attrs.Attribute) -> Any:
    if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
        value = field.default.factory()
        return None if attrs.has(type(value)) else value
    return field.default


def _class_schema(cls: type) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for field in attrs.fields(cls):
        if cls is Recipe and field.name == "algo":
            props["algo"] = {
                "description": field.metadata["help"],
                "type": "object",
                "oneOf": [_class_schema(c) for c in ALGO_KINDS.values()],
            }
            continue
        node = _type_schema(field.type)
        node["description"] = field.metadata.get("help", "")
        default = _default(field)
        if default is not None:
            node["default"] = default
        props[field.name] = node
    return {"type": "object", "properties": props, "additionalProperties": False}


def build_schema() -> dict[str, Any]:
    schema = _class_schema(Recipe)
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "posttrain-runner recipe",
        "description": "One TOML recipe describes a whole post-training run.",
        **schema,
    }
    return schema


def render() -> str:
    return json.dumps(build_schema(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0]) if args else SCHEMA_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render(), encoding="utf-8")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
