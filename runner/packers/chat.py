"""What a DataPacker owns of a chat conversation: the tokens of an environment's messages (the
chat template's difference, never a re-tokenised reply) and the tool calls written in a reply.

An episode's tokens are the prompt the template renders from the opening messages, then for each
turn the engine's generated ids (ending with the eos token) and the template's rendering of the
environment's answer. That rendering is the difference between the conversation rendered with
the answer (and the next generation prompt) and without it, taken from the template's first
token after the assistant's eos (Qwen writes a newline there, which the engine never generates).
It is exact only where the template is append-only for these messages: rendering the longer
conversation must keep the shorter one's tokens as its prefix, at both ends of the assistant's
turn. ``template_delta`` checks both and raises ``NotAppendOnly`` otherwise (a template that
rewrites earlier turns, e.g. one that drops an earlier turn's reasoning, is refused; a packer can
supply its own renderer instead: ``DataPacker.env_message_ids``).

Tool calls: ``parse_hermes_tool_calls`` reads the Qwen / Hermes syntax
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the built-in packers' default.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
Render = Callable[[list[dict[str, Any]], bool], list[int]]  # (messages, generation prompt) -> ids


class NotAppendOnly(ValueError):
    """The template rendered a longer conversation whose tokens do not extend the shorter's."""


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def template_delta(render: Render, eos_token_id: int, conversation: Sequence[dict[str, Any]],
                   new_messages: Sequence[dict[str, Any]]) -> list[int]:
    """The ids that follow the assistant's eos when ``new_messages`` are appended to
    ``conversation`` (whose last message is the assistant's) and the model is prompted again.

    >>> template = lambda msgs, gen: [t for m in msgs for t in (m["role"][0], m["content"], 0)] \\
    ...     + (["a"] if gen else [])
    >>> template_delta(template, 0, [{"role": "user", "content": "q"},
    ...                              {"role": "assistant", "content": "r"}],
    ...                [{"role": "tool", "content": "x"}])
    ['t', 'x', 0, 'a']
    """
    conversation = list(conversation)
    asked = render(conversation[:-1], True)  # the prompt the assistant's turn was sampled from
    answered = render(conversation, False)
    extended = render(conversation + list(new_messages), True)
    if answered[:len(asked)] != asked:
        at = _first_difference(asked, answered)
        raise NotAppendOnly(f"rendering the assistant's reply changes the prompt it was sampled "
                            f"from at token {at}")
    if extended[:len(answered)] != answered:
        at = _first_difference(answered, extended)
        raise NotAppendOnly(f"rendering the environment's messages changes the earlier "
                            f"conversation at token {at}")
    turn = answered[len(asked):]
    ends = [i for i, t in enumerate(turn) if t == eos_token_id]
    if not ends:
        raise NotAppendOnly("the template does not close the assistant's turn with the eos "
                            "token the engine stops on")
    return list(turn[ends[-1] + 1:]) + list(extended[len(answered):])


@attrs.frozen
class ToolCall:
    """One call parsed from a reply: the tool's name and arguments, or why it could not be
    parsed (``error``; then ``name`` may be empty)."""

    name: str
    arguments: dict[str, Any] = attrs.field(factory=dict)
    error: str = ""


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """The calls in ``text`` written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (Qwen 2.5 / 3, Hermes). A block that is not such an object is a call with an ``error``.

    >>> parse_hermes_tool_calls('<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}'
    ...                         '</tool_call>')
    [ToolCall(name='mul', arguments={'a': 2, 'b': 3}, error='')]
    >>> parse_hermes_tool_calls('<tool_call>{"name": mul}</tool_call>')[0].error
    'the call is not valid JSON: Expecting value at char 9'
    """
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            raw = json.loads(block)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", error=f"the call is not valid JSON: {exc.msg} at char "
                                  f"{exc.pos}"))
            continue
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            calls.append(ToolCall("", error='the call is not an object with a "name" string'))
            continue
        args = raw.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(raw["name"], error='"arguments" is not an object'))
            continue
        calls.append(ToolCall(raw["name"], args))
    return calls


@attrs.frozen
class RenderedConversation:
    """A conversation's tokens as the template renders it, with a 0/1 mask of those trained."""

    ids: tuple[int, ...]
    mask: tuple[int, ...]


def _extends(longer: Sequence[int], shorter: Sequence[int], what: str, n: int) -> None:
    if list(longer[:len(shorter)]) != list(shorter):
        at = _first_difference(shorter, longer)
        raise NotAppendOnly(f"rendering {what} changes the conversation before message {n} at "
                            f"token {at}")


def render_conversation(render: Render, eos_token_id: int, messages: Sequence[dict[str, Any]],
                        loss_on: str) -> RenderedConversation:
    """The tokens of ``messages`` rendered prefix by prefix, and which of them are trained.

    For each assistant message n the template renders the messages before it with the
    generation prompt (what the model is asked with), then with message n: both must extend
    the tokens so far (the append-only rule of ``template_delta``, else ``NotAppendOnly``).
    The turn's tokens up to and including its last eos token are the assistant's (what an
    engine would sample); the template's tokens after that eos and before the next turn are
    not. ``loss_on``: "assistant" trains every assistant turn, "last_assistant" the last,
    "all" every token. Messages after the last assistant message are left out (nothing in
    them is trained).

    >>> template = lambda msgs, gen: [t for m in msgs for t in (m["role"][0], m["content"], 0)] \\
    ...     + (["a"] if gen else [])
    >>> r = render_conversation(template, 0, [{"role": "user", "content": "q"},
    ...                                       {"role": "assistant", "content": "r"}], "assistant")
    >>> list(zip(r.ids, r.mask))
    [('u', 0), ('q', 0), (0, 0), ('a', 0), ('r', 1), (0, 1)]
    """
    turns = [n for n, m in enumerate(messages) if m.get("role") == "assistant"]
    ids: list[Any] = []
    mask: list[int] = []
    for n in turns:
        asked = render(list(messages[:n]), True)
        _extends(asked, ids, "the generation prompt", n)
        answered = render(list(messages[:n + 1]), False)
        _extends(answered, asked, "the assistant's message", n)
        turn = list(answered[len(asked):])
        ends = [i for i, t in enumerate(turn) if t == eos_token_id]
        if not ends:
            raise NotAppendOnly(f"the template does not close the assistant's message {n} with "
                                "the eos token")
        trained = loss_on == "all" or loss_on == "assistant" or n == turns[-1]
        head = [0 if loss_on != "all" else 1] * (len(asked) - len(ids))
        mask += head + [int(trained)] * (ends[-1] + 1) + [int(loss_on == "all")] * (
            len(turn) - ends[-1] - 1)
        ids += list(asked[len(ids):]) + turn
    return RenderedConversation(tuple(ids), tuple(mask))


def hermes_tool_call_text(call: dict[str, Any]) -> str:
    """One OpenAI tool call (``{"function": {"name", "arguments"}}``) in the syntax
    ``parse_hermes_tool_calls`` reads back.

    >>> hermes_tool_call_text({"type": "function", "function": {"name": "add",
    ...                        "arguments": '{"a": 1}'}})
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    """
    fn = call["function"]
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # written as given: the model learns the text it was shown
    return f"<tool_call>{json.dumps({'name': fn['name'], 'arguments': args})}</tool_call>"


def with_tool_calls_written(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template that knows no ``tool_calls``: each assistant message's calls
    written after its content in the Hermes syntax (the built-in packers' ``parse_tool_calls``),
    a null content as ""."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls or m.get("content") is None:
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m.get("content") or "") + "".join(
                hermes_tool_call_text(c) for c in calls or ())
        out.append(m)
    return out
