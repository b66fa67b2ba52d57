"""Column mapping: a raw row (a mapping with the source's own column names) -> ObsBundle.

``prompt_column`` becomes ``ObsBundle.prompt`` and ``response_column`` ``.reference``; SFT's
``messages_column`` (when set) becomes ``.prompt`` instead, a checked list of chat messages
(``runner.data.conversations``). PPO also
maps ``image_column``, ``video_column`` and ``id_column``, and copies only the columns listed in
``metadata_columns`` into ``.metadata``: any other field of the row stays behind.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from runner.data.conversations import messages_problem, tools_problem
from runner.errors import Problem, RecipeError
from runner.recipe.algos import ALGORITHMS
from runner.recipe.schema import DataConfig
from runner.types import MediaOrigin, ObsBundle


@attrs.frozen
class ColumnMap:
    """Which raw column feeds which ObsBundle field; "" means the field stays empty."""

    prompt: str
    response: str = ""
    image: str = ""
    video: str = ""
    id: str = ""
    metadata: tuple[str, ...] = ()
    messages: str = ""  # a column of whole conversations, read instead of prompt and response
    tools: str = ""  # with messages: a column of each conversation's tool schemas

    @property
    def text(self) -> str:
        """The column whose value is the item's prompt (its conversation, with messages)."""
        return self.messages or self.prompt

    def describe(self) -> str:
        """Canonical text of the mapping, e.g. ``prompt=question response=answer``.

        Part of the cursor fingerprint: renaming a column changes what an index means.
        """
        if self.messages:
            return (f"messages={self.messages}" + (f" tools={self.tools}" if self.tools else "")
                    + (f" image={self.image}" if self.image else ""))
        pairs = [("prompt", self.prompt), ("response", self.response), ("image", self.image),
                 ("video", self.video), ("id", self.id), ("metadata", ",".join(self.metadata))]
        return " ".join(f"{name}={value}" for name, value in pairs if value)

    def apply(self, row: Mapping[str, Any], *, where: str) -> ObsBundle:
        """The canonical item of ``row``; ``where`` names the row in errors (e.g.
        "row 3 of ...")."""
        get = _Getter(row, where)
        if self.messages:
            value = get(self.messages, "data.messages_column")
            check_value(messages_problem(value), where, self.messages, "data.messages_column")
            tools = get(self.tools, "data.tools_column") if self.tools else ()
            check_value(tools_problem(tools), where, self.tools, "data.tools_column")
            return ObsBundle(prompt=[dict(m) for m in value],
                             images=(as_tuple(get(self.image, "data.image_column"))
                                     if self.image else ()),
                             origin=MediaOrigin(where, self.image, "", self.messages),
                             tools=tuple(dict(t) for t in tools or ()))
        prompt = get(self.prompt, "data.prompt_column")
        check_value(prompt_problem(prompt), where, self.prompt, "data.prompt_column")
        reference = ""
        if self.response:
            raw = get(self.response, "data.response_column")
            check_value(reference_problem(raw), where, self.response, "data.response_column")
            reference = _as_text(raw)
        return ObsBundle(
            prompt=prompt,
            reference=reference,
            images=as_tuple(get(self.image, "data.image_column")) if self.image else (),
            videos=as_tuple(get(self.video, "data.video_column")) if self.video else (),
            id=str(get(self.id, "data.id_column")) if self.id else "",
            metadata={name: get(name, "data.metadata_columns") for name in self.metadata},
            origin=MediaOrigin(where, self.image, self.video, self.prompt),
        )


def column_map(data: DataConfig, algo_kind: str) -> ColumnMap:
    """The mapping a recipe asks for: the prompt and response columns, and those of the
    algorithm's own keys (``AlgoSpec.owned_keys``: image and video columns, id and metadata
    columns). Keys of other algorithms are refused with the recipe
    (``runner.recipe.checks.check_algorithm_keys``)."""
    reads = ALGORITHMS[algo_kind].reads
    return ColumnMap(
        prompt=data.prompt_column, response=data.response_column,
        image=data.image_column if reads("data.image_column") else "",
        video=data.video_column if reads("data.video_column") else "",
        id=data.id_column if reads("data.id_column") else "",
        metadata=tuple(data.metadata_columns) if reads("data.metadata_columns") else (),
        messages=data.messages_column if reads("data.messages_column") else "",
        tools=data.tools_column if reads("data.tools_column") else "")


class _Getter:
    def __init__(self, row: Mapping[str, Any], where: str) -> None:
        self.row, self.where = row, where

    def __call__(self, column: str, key: str) -> Any:
        try:
            return self.row[column]
        except KeyError:
            raise missing_column(column, key, self.where, list(self.row)) from None


def missing_column(column: str, key: str, where: str, columns: list[str]) -> RecipeError:
    shown = ", ".join(repr(c) for c in columns[:20]) + (" ..." if len(columns) > 20 else "")
    return RecipeError([Problem(
        key, f"column {column!r} is not in {where} (its columns: {shown or 'none'})",
        hint=f"set {key} to one of its columns, or reshape rows with data.items_fn")])


def prompt_problem(value: Any) -> str:
    """Why ``value`` cannot be a prompt, or "": a prompt is text (a number is taken as its
    text) or a list of chat messages, each a mapping with a text ``role`` and a ``content``."""
    if value is None:
        return "is null or missing"
    if isinstance(value, str):
        return ""
    if isinstance(value, float) and value != value:
        return "is empty (NaN)"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return ""
    if isinstance(value, list | tuple):
        for n, message in enumerate(value):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or \
                    not isinstance(message.get("content"), str | list):
                return (f"is a list whose element {n} is not a chat message (a mapping with a "
                        "text 'role' and a 'content')")
        return "" if value else "is an empty list of chat messages"
    kind = "a mapping" if isinstance(value, Mapping) else f"a {type(value).__name__}"
    return f"is {kind}, not text or a list of chat messages"


def reference_problem(value: Any) -> str:
    """Why ``value`` cannot be a reference answer, or "" (text, a number, a list or table)."""
    if value is None:
        return "is null or missing (the reward would compare against nothing)"
    if isinstance(value, float) and value != value:
        return "is empty (NaN)"
    return ""


def check_value(problem: str, where: str, column: str, key: str) -> None:
    """Raise the RecipeError naming the row and column when ``problem`` is not ""."""
    if problem:
        raise RecipeError([Problem(key, f"{where}: column {column!r} {problem}",
                                   hint="fix or drop the row, or reshape rows with "
                                   "data.items_fn")])


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list | dict | tuple):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(value)
    return (value,)
