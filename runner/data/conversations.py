"""Conversations for SFT: chat messages in the OpenAI format, checked before anything renders
them, and the held-out prompt each one is evaluated with.

A conversation is an item's ``prompt`` when the source reads ``data.messages_column`` (a list
of messages), else its prompt as one user message followed by its reference (the
``response_column``, or the built-in arithmetic answer) as the assistant's. A message is a
mapping with a ``role`` (system, user, assistant or tool) and a text ``content``; an assistant
message may instead (or also) carry ``tool_calls`` (each ``{"type": "function", "function":
{"name": ..., "arguments": ...}}``, its content then null or text), and a tool message answers
one. Every conversation holds an assistant message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from runner.errors import Problem, RecipeError
from runner.types import ObsBundle

ROLES = ("system", "user", "assistant", "tool")


def _call_problem(call: Any, n: int, k: int) -> str:
    """Why tool call ``k`` of message ``n`` is not an OpenAI function call, or ""."""
    field = f"messages[{n}].tool_calls[{k}]"
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping):
        return f"{field} is not a mapping with a 'function' mapping"
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        return f"{field}.function.name is not a non-empty text"
    if not isinstance(fn.get("arguments", {}), str | Mapping):
        return f"{field}.function.arguments is neither a mapping nor JSON text"
    return ""


def tools_problem(tools: Any) -> str:
    """Why a row's tool schemas are not a list of OpenAI function tools, or "" (none, an empty
    list or null are no tools). ``tools[k].FIELD`` names the field.

    >>> tools_problem([{"type": "function", "function": {"name": "add"}}]), tools_problem(None)
    ('', '')
    >>> tools_problem([{"function": {}}])
    'tools[0].function.name is not a non-empty text'
    """
    if tools is None:
        return ""
    if not isinstance(tools, list | tuple):
        return f"is {_kind(tools)}, not a list of tool schemas"
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping):
            return f"tools[{k}] is not a mapping with a 'function' mapping"
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"tools[{k}].function.name is not a non-empty text"
    return ""


def _message_problem(message: Any, n: int) -> str:
    """Why element ``n`` is not a chat message, or "" (``messages[n].FIELD`` names the field)."""
    if not isinstance(message, Mapping):
        return f"messages[{n}] is {_kind(message)}, not a mapping"
    role = message.get("role")
    if role not in ROLES:
        return f"messages[{n}].role is {role!r}, not one of {', '.join(ROLES)}"
    content, calls = message.get("content"), message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            return f"messages[{n}].tool_calls is set on a {role} message (assistant only)"
        if not isinstance(calls, list | tuple) or not calls:
            return f"messages[{n}].tool_calls is not a non-empty list"
        for k, call in enumerate(calls):
            if problem := _call_problem(call, n, k):
                return problem
        if content is None:
            return ""
    if isinstance(content, list | tuple) and role in ("user", "system"):
        return _parts_problem(content, n)
    if not isinstance(content, str):
        return f"messages[{n}].content is {_kind(content)}, not text" + (
            " (a list of parts is read in user and system messages)"
            if isinstance(content, list | tuple) else "")
    return ""


def _parts_problem(parts: Any, n: int) -> str:
    """Why a message's content parts are not text and image parts (OpenAI format: ``{"type":
    "text", "text": ...}``, ``{"type": "image"}``; an image part's picture is the row's next
    ``data.image_column`` entry), or ""."""
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind != "image":
            return (f"messages[{n}].content[{k}] is not a text part ({{type: text, text}}) or an "
                    "image part ({type: image})")
    return ""


def image_parts(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many image parts the messages hold."""
    return sum(1 for m in messages if isinstance(m.get("content"), list | tuple)
               for part in m["content"]
               if isinstance(part, Mapping) and part.get("type") == "image")


def messages_problem(value: Any) -> str:
    """Why ``value`` cannot be a conversation, or "" (the first field at fault, named)."""
    if value is None:
        return "is null or missing"
    if not isinstance(value, list | tuple):
        return f"is {_kind(value)}, not a list of chat messages"
    for n, message in enumerate(value):
        if problem := _message_problem(message, n):
            return "is not a conversation: " + problem
    if not any(m["role"] == "assistant" for m in value):
        return "has no assistant message (nothing to train on)"
    return ""


def _kind(value: Any) -> str:
    return "null" if value is None else f"of type {type(value).__name__}"


def conversation_of(item: ObsBundle) -> list[dict[str, Any]]:
    """The conversation of a checked item: its messages, or its prompt and reference as one
    user and one assistant message. An item with images (``data.image_column``) whose messages
    hold no image part gets one per image at the start of its first user message; messages that
    hold image parts must hold one per image."""
    where = item.origin.where or f"item {item.id or str(item.prompt)[:40]!r}"
    if isinstance(item.prompt, list | tuple):
        messages = [dict(m) for m in item.prompt]
    else:
        if not item.reference:
            raise RecipeError([Problem(
                "data.response_column", f"{where}: no response to train on (SFT needs "
                "data.response_column, or data.messages_column)",
                hint="set data.response_column to the answers' column")])
        messages = [{"role": "user", "content": str(item.prompt)},
                    {"role": "assistant", "content": item.reference}]
    return with_images(messages, len(item.images), where)


def with_images(messages: list[dict[str, Any]], count: int, where: str
                ) -> list[dict[str, Any]]:
    """``messages`` with ``count`` images placed (see ``conversation_of``)."""
    parts = image_parts(messages)
    if parts == count:
        return messages
    if parts:
        raise RecipeError([Problem("data.image_column", f"{where}: its messages hold {parts} "
                                   f"image part(s) but the row has {count} image(s)",
                                   hint="give one image per {type: image} part, or no parts "
                                   "(the images then open the first user message)")])
    first = next((n for n, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        raise RecipeError([Problem("data.image_column", f"{where}: {count} image(s) but no "
                                   "user message to show them in")])
    content = messages[first].get("content")
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    messages[first] = {**messages[first], "content": [{"type": "image"}] * count + text}
    return messages


def generation_item(item: ObsBundle) -> ObsBundle:
    """The held-out prompt of a conversation: its messages before the last assistant message,
    whose text is the reference; the whole conversation in ``metadata["conversation"]`` (the
    held-out NLL reads it)."""
    messages = conversation_of(item)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    reference = messages[last].get("content") or ""
    prompt: Any = messages[:last] if isinstance(item.prompt, list | tuple) else item.prompt
    return ObsBundle(prompt, reference=str(reference), images=item.images, id=item.id,
                     metadata={**item.metadata, "conversation": messages}, origin=item.origin,
                     tools=item.tools)
