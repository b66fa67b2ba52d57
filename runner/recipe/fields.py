"""How a recipe key is declared: its one default and one help text (which feed the JSON schema
and the CLI's help), and a table's default instance."""

from typing import Any

import attrs


def key(default: Any, help: str) -> Any:
    """A recipe key: its one default and its one help text (which feeds the JSON schema)."""
    if isinstance(default, list | dict):
        factory = (lambda d=default: type(d)(d))  # noqa: E731 - fresh copy per instance
        return attrs.field(factory=factory, metadata={"help": help})
    return attrs.field(default=default, metadata={"help": help})


def default_of(cls: type, name: str) -> Any:
    """The schema's default of key ``name`` of table ``cls``: the one place defaults live, for
    layers that need one outside a recipe."""
    default = attrs.fields_dict(cls)[name].default
    return default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]


def table(cls: type, help: str) -> Any:
    return attrs.field(factory=cls, metadata={"help": help})
