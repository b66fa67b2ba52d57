"""Tools: plain Python callables offered to the model, described from their signatures, called
from the model's replies under a time limit.

A tool is described to the chat template as an OpenAI-style function schema (``tool_schema``):
its name, the first paragraph of its docstring, and one JSON-schema property per parameter, typed
from the annotation. The model's replies are parsed by its DataPacker (``parse_tool_calls``; the
Qwen / Hermes syntax ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` by default), and
each call runs in a daemon thread of its own under ``env.tool_timeout_s``, and so does the
conversion of its result to text (``json.dumps``, else ``str``). Whatever goes wrong in a call
(malformed JSON, an unknown tool, arguments that do not bind, an exception, a result that cannot
be rendered as text, the time limit) becomes the tool message the model reads next, never a
crash: a call still running at the deadline cannot be stopped from outside, so its thread is
abandoned (it never blocks the process from exiting) and the episode goes on.

A result's text is bounded before anything tokenises it: cut to ``MAX_TOOL_RESULT_CHARS``
characters, ending in a line that says how long it was (the episode cuts it further, to what its
remaining tokens can spell). Lone surrogates, which no
tokenizer can encode, are replaced by U+FFFD.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from runner.packers.chat import ToolCall

MAX_TOOL_RESULT_CHARS = 65_536  # a tool message's characters at most
_SURROGATES = re.compile("[\ud800-\udfff]")

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", tuple: "array", dict: "object"}


def _json_type(annotation: Any) -> str:
    if isinstance(annotation, str):  # postponed annotations: the common names
        return {"int": "integer", "float": "number", "str": "string", "bool": "boolean",
                "list": "array", "dict": "object"}.get(annotation.split("[")[0], "string")
    origin = typing.get_origin(annotation) or annotation
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else "string"
    return _JSON_TYPES.get(origin, "string")


def tool_schema(fn: Callable[..., Any], name: str = "") -> dict[str, Any]:
    """The chat template's description of ``fn``: an OpenAI-style function schema.

    >>> def add(a: int, b: int = 0) -> int:
    ...     '''Add two integers.'''
    ...     return a + b
    >>> tool_schema(add)["function"]["parameters"]
    {'type': 'object', 'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}, \
'required': ['a']}
    """
    sig = inspect.signature(fn)
    props, required = {}, []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[p.name] = {"type": _json_type(p.annotation)
                         if p.annotation is not p.empty else "string"}
        if p.default is p.empty:
            required.append(p.name)
    doc = inspect.getdoc(fn) or ""
    return {"type": "function", "function": {
        "name": name or fn.__name__, "description": doc.split("\n\n")[0].strip(),
        "parameters": {"type": "object", "properties": props, "required": required}}}


@attrs.frozen
class ToolResult:
    content: str  # what the tool message says
    failed: bool  # the call could not run, raised, or timed out


def run_with_timeout(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """(finished, result or the exception raised) of ``fn()`` in a daemon thread; after
    ``timeout_s`` seconds (0: no limit) the thread is abandoned and ``finished`` is false."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            box["error"] = exc

    thread = threading.Thread(target=body, daemon=True, name="posttrain-call")
    thread.start()
    thread.join(timeout_s if timeout_s > 0 else None)
    if thread.is_alive():
        return False, None
    return True, box["error"] if "error" in box else box.get("value")


class ToolBox:
    """The recipe's tools by name: their schemas for the chat template, and their calls."""

    def __init__(self, tools: Mapping[str, Callable[..., Any]], timeout_s: float) -> None:
        self.tools = dict(tools)
        self.timeout_s = timeout_s
        self.schemas = [tool_schema(fn, name) for name, fn in self.tools.items()]

    def __bool__(self) -> bool:
        return bool(self.tools)

    def call(self, call: ToolCall) -> ToolResult:
        if call.error:
            return ToolResult(f"error: {call.error}", True)
        fn = self.tools.get(call.name)
        if fn is None:
            return ToolResult(f"error: unknown tool {call.name!r}; the tools are "
                              f"{', '.join(self.tools)}", True)
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as exc:
            return ToolResult(f"error: {call.name}: {exc}", True)
        except ValueError:
            pass  # no signature to check against: let the call say
        finished, value = run_with_timeout(lambda: _called(call.name, fn, call.arguments),
                                           self.timeout_s)
        if not finished:
            return ToolResult(f"error: {call.name} timed out after {self.timeout_s:g} s", True)
        if isinstance(value, BaseException):  # SystemExit and the like, past _called's guard
            return ToolResult(f"error: {call.name} raised {type(value).__name__}", True)
        return value


def _called(name: str, fn: Callable[..., Any], arguments: dict[str, Any]) -> ToolResult:
    """The tool message of ``fn(**arguments)``, made on the tool's own thread (under its time
    limit): its result as text (cut to ``MAX_TOOL_RESULT_CHARS``), or what went wrong."""
    try:
        value = fn(**arguments)
    except Exception as exc:  # noqa: BLE001 - a tool may raise anything: the model is told
        return ToolResult(_clean(f"error: {name} raised {_describe(exc)}"), True)
    try:
        text = cut_text(_as_text(value), MAX_TOOL_RESULT_CHARS)
    except Exception as exc:  # noqa: BLE001 - a result's __str__ may raise anything, or recurse
        return ToolResult(_clean(f"error: {name} returned a {type(value).__name__} that cannot "
                                 f"be rendered as text: {_describe(exc)}"), True)
    return ToolResult(_clean(text), False)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return str.__str__(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _describe(exc: BaseException) -> str:
    """``Type: message``, or the type alone when the message cannot be rendered."""
    try:
        message = cut_text(str(exc), MAX_TOOL_RESULT_CHARS)
    except Exception:  # noqa: BLE001 - an exception's own __str__ may raise
        return f"{type(exc).__name__} (its message cannot be rendered)"
    return f"{type(exc).__name__}: {message}"


def _clean(text: str) -> str:
    """``text`` with each lone surrogate (which no tokenizer encodes) replaced by U+FFFD."""
    return _SURROGATES.sub("\ufffd", text)


def cut_text(text: str, limit: int) -> str:
    """``text`` unchanged when it has at most ``limit`` characters; else its start followed by a
    line saying how long it was, ``limit`` characters in all.

    >>> cut_text("abcdefghijklmnopqrstuvwxyz0123456789" * 2, 40)
    'abcdefghijkl\\n[cut: 72 characters in all]'
    """
    if len(text) <= limit:
        return text
    marker = f"\n[cut: {len(text):,} characters in all]"
    keep = limit - len(marker)
    return text[:keep] + marker if keep > 0 else text[:max(0, limit)]


def tool_messages(box: ToolBox, calls: Sequence[ToolCall]) -> tuple[list[dict[str, str]], int]:
    """One ``tool`` message per call (in order) and how many failed."""
    results = [box.call(c) for c in calls]
    return ([{"role": "tool", "name": c.name, "content": r.content}
             for c, r in zip(calls, results, strict=True)], sum(r.failed for r in results))
