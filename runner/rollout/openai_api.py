"""The OpenAI API as the runner speaks it (``posttrain-run serve``, and agents trained over it),
without a server: requests
checked field by field (a bad one is an ``ApiError`` naming the field, answered in OpenAI's error
shape), and the bodies of responses and stream chunks.

Fields the server does not use (``user``, ``presence_penalty``, ``stream_options`` other than
``include_usage``, ...) are accepted and ignored, as agents send them; ``model`` may name any
model (the response names the one served), so an agent written for another endpoint runs
unchanged. Assistant messages that carry ``tool_calls`` are rendered by the DataPacker: by a
chat template that knows ``tool_calls``, else with each call written as the model writes one
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from runner.rollout.base import RolloutOutput

if TYPE_CHECKING:
    from runner.packers.base import DataPacker

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 64
MAX_STOPS = 4


class ApiError(Exception):
    """A request answered with an error: its HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}


def bad(param: str, message: str) -> ApiError:
    """A 400 naming ``param``: ``"<param>: <message>"``."""
    return ApiError(400, f"{param}: {message}", param)


@attrs.frozen
class Sampling:
    """How one request samples (OpenAI's names; ``temperature = 0`` is greedy)."""

    n: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    logprobs: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


@attrs.frozen
class ChatRequest:
    messages: tuple[dict[str, Any], ...]  # as the chat template takes them
    tools: tuple[dict[str, Any], ...]  # empty: none (or tool_choice "none")
    sampling: Sampling


@attrs.frozen
class CompletionRequest:
    prompt: str | tuple[int, ...]
    sampling: Sampling


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float,
            *, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(key, f"must be a number, got {json.dumps(value)[:40]}")
    if value < low or value > high or (low_open and value == low):
        side = "(" if low_open else "["
        raise bad(key, f"must be in {side}{low:g}, {high:g}], got {value:g}")
    return float(value)


def _integer(body: Mapping[str, Any], key: str, default: int | None, low: int, high: int
             ) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"must be an integer, got {json.dumps(value)[:40]}")
    if not low <= value <= high:
        raise bad(key, f"must be in [{low}, {high}], got {value}")
    return value


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(key, f"must be true or false, got {json.dumps(value)[:40]}")
    return value


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"takes at most {MAX_STOPS} sequences, got {len(stops)}")
    return tuple(stops)


def sampling_of(body: Mapping[str, Any], max_tokens: int, limit: int) -> Sampling:
    """The request's sampling: ``max_tokens`` is the default length, ``limit`` the most new
    tokens the model's context allows."""
    new = _integer(body, "max_completion_tokens", None, 1, limit)
    new = _integer(body, "max_tokens", new if new is not None else min(max_tokens, limit), 1,
                   limit)
    if body.get("top_logprobs"):
        raise bad("top_logprobs", "is not supported: the engine returns the sampled token's "
                  "logprob only (logprobs: true)")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
    assert new is not None
    return Sampling(n=_integer(body, "n", 1, 1, MAX_N) or 1, max_tokens=new,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                    seed=_integer(body, "seed", None, -(2 ** 63), 2 ** 63 - 1),
                    stop=_stops(body), logprobs=_flag(body, "logprobs"),
                    stream=_flag(body, "stream"),
                    include_usage=bool(options.get("include_usage", False)))


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}.content[{i}]", f"only text parts are served, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{i}].text", "must be a string")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content", "must be a string or a list of text parts")


def _calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked (the packer renders them: a template that
    knows ``tool_calls`` itself, else written in the syntax the model writes them in)."""
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls", "must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}.tool_calls[{i}].function.name", "must be a string")
        raw = fn.get("arguments", "{}")
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as exc:
            raise bad(f"{where}.tool_calls[{i}].function.arguments",
                      f"is not JSON ({exc.msg})") from exc
        out.append({"type": "function", "id": str(call.get("id", "")),
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _message(raw: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise bad(where, "must be an object with a role and content")
    role = raw.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    calls = raw.get("tool_calls") if role == "assistant" else None
    content = raw.get("content")
    text = "" if content is None and calls else _text(content, where)
    message: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": text}
    if calls:
        message["tool_calls"] = _calls(calls, where)
    if role == "tool" and isinstance(raw.get("name"), str):
        message["name"] = raw["name"]
    return message


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    tools = body.get("tools") or []
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise bad("tool_choice", "only 'auto' and 'none' are served (the model decides "
                  f"whether to call a tool), got {json.dumps(choice)[:60]}")
    if not isinstance(tools, list):
        raise bad("tools", "must be a list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": "
                      "{\"name\": ..., \"parameters\": {...}}}")
        fn.setdefault("parameters", {"type": "object", "properties": {}})
    return () if choice == "none" else tuple(tools)


def chat_request(body: Any, max_tokens: int, limit: int) -> ChatRequest:
    """A ``POST /v1/chat/completions`` body, checked."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list")
    return ChatRequest(tuple(_message(m, i) for i, m in enumerate(messages)), _tools(body),
                       sampling_of(body, max_tokens, limit))


def completion_request(body: Any, max_tokens: int, limit: int) -> CompletionRequest:
    """A ``POST /v1/completions`` body, checked: one prompt, text or token ids."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        prompt = tuple(prompt)
    if not isinstance(prompt, str | tuple) or not prompt:
        raise bad("prompt", "must be a non-empty string or list of token ids (one prompt)")
    if body.get("echo") or body.get("suffix") or (body.get("best_of") or 1) != 1:
        raise bad("echo" if body.get("echo") else "suffix" if body.get("suffix") else "best_of",
                  "is not supported")
    return CompletionRequest(prompt, sampling_of(body, max_tokens, limit))


@attrs.frozen
class Choice:
    """One sampled completion, as the server answers it."""

    text: str  # after the stop sequence (if any) was cut
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    tokens: tuple[str, ...]  # each token's text
    finish_reason: str  # "stop", "length" or "tool_calls"
    calls: tuple[tuple[str, str], ...] = ()  # (name, arguments as JSON) of each tool call
    content: str | None = None  # the text outside the tool calls (chat)


def _logprobs(choice: Choice, chat: bool) -> dict[str, Any] | None:
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": []}
                            for t, lp in zip(choice.tokens, choice.logprobs, strict=True)]}
    return {"tokens": list(choice.tokens), "token_logprobs": list(choice.logprobs),
            "top_logprobs": None, "text_offset": _offsets(choice.tokens)}


def _offsets(tokens: Sequence[str]) -> list[int]:
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


def tool_calls(choice: Choice, rid: str, i: int) -> list[dict[str, Any]]:
    return [{"id": f"call_{rid[-12:]}_{i}_{k}", "type": "function",
             "function": {"name": name, "arguments": args}}
            for k, (name, args) in enumerate(choice.calls)]


def usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def chat_body(rid: str, created: int, model: str, prompt_ids: Sequence[int],
              choices: Sequence[Choice], want_logprobs: bool) -> dict[str, Any]:
    """The ``chat.completion`` object; ``prompt_token_ids`` and each choice's ``token_ids`` are
    this server's extension (the exact tokens the engine read and sampled)."""
    out = []
    for i, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.calls:
            message["tool_calls"] = tool_calls(c, rid, i)
        out.append({"index": i, "message": message, "finish_reason": c.finish_reason,
                    "logprobs": _logprobs(c, True) if want_logprobs else None,
                    "token_ids": list(c.token_ids)})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": out, "usage": usage(len(prompt_ids), choices),
            "prompt_token_ids": list(prompt_ids)}


def completion_body(rid: str, created: int, model: str, prompt_ids: Sequence[int],
                    choices: Sequence[Choice], want_logprobs: bool) -> dict[str, Any]:
    """The ``text_completion`` object (with the same token-id extension)."""
    out = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
            "logprobs": _logprobs(c, False) if want_logprobs else None,
            "token_ids": list(c.token_ids)} for i, c in enumerate(choices)]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": out, "usage": usage(len(prompt_ids), choices),
            "prompt_token_ids": list(prompt_ids)}


def chat_chunks(rid: str, created: int, model: str, prompt_ids: Sequence[int],
                choices: Sequence[Choice], sampling: Sampling) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed answer, in order: per choice its
    role, its content a token at a time, its tool calls, its finish reason; then the usage
    when ``stream_options.include_usage`` asked for it."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    chunks = []
    for i, c in enumerate(choices):
        def delta(d: dict[str, Any], finish: str | None = None, lp: Any = None,
                  i: int = i) -> dict[str, Any]:
            choice = {"index": i, "delta": d, "finish_reason": finish, "logprobs": lp}
            return {**head, "choices": [choice]}

        chunks.append(delta({"role": "assistant", "content": ""}))
        if c.calls:
            if c.content:
                chunks.append(delta({"content": c.content}))
            chunks.append(delta({"tool_calls": [{"index": k, **call} for k, call in
                                                enumerate(tool_calls(c, rid, i))]}))
        else:
            for k, piece in enumerate(_pieces(c)):
                lp = ({"content": [{"token": c.tokens[k], "logprob": c.logprobs[k],
                                    "bytes": list(c.tokens[k].encode()), "top_logprobs": []}]}
                      if sampling.logprobs and k < len(c.tokens) else None)
                chunks.append(delta({"content": piece}, lp=lp))
        chunks.append(delta({}, c.finish_reason))
    if sampling.include_usage:
        chunks.append({**head, "choices": [], "usage": usage(len(prompt_ids), choices)})
    return chunks


def _pieces(c: Choice) -> list[str]:
    """The content a token at a time, adding up to the content exactly (a stop sequence's cut
    can end inside a token: the last piece is what is left)."""
    text = c.content or ""
    pieces, sent = [], 0
    for token in c.tokens:
        if sent >= len(text):
            break
        piece = text[sent:sent + len(token)]
        pieces.append(piece)
        sent += len(piece)
    if sent < len(text):
        pieces.append(text[sent:])
    return pieces


def choices(packer: DataPacker, output: RolloutOutput, sampling: Sampling, *, chat: bool,
            tools: bool) -> list[Choice]:
    """An engine output's completions as answered: cut at the first stop sequence, and (chat
    with tools) the tool calls ``packer`` parses out of the text. The ids and logprobs are the
    engine's, the eos that ended a completion included."""
    out = []
    for c in output.completions:
        ids, text, logprobs, finish = (list(c.token_ids), c.text, list(c.logprobs),
                                       c.finish_reason)
        cut = _first_stop(text, sampling.stop)
        if cut is not None:
            text, finish = text[:cut], "stop"
            keep = _tokens_covering(packer, ids, len(text))
            ids, logprobs = ids[:keep], logprobs[:keep]
        tokens = tuple(packer.decode([t], skip_special_tokens=False) for t in ids)
        choice = Choice(text, tuple(ids), tuple(logprobs), tokens, finish, (), text)
        out.append(with_calls(packer, choice) if chat and tools else choice)
    return out


def _tokens_covering(packer: DataPacker, ids: Sequence[int], chars: int) -> int:
    """The fewest leading tokens whose text is at least ``chars`` characters long."""
    for k in range(len(ids) + 1):
        if len(packer.decode(ids[:k])) >= chars:
            return k
    return len(ids)


def with_calls(packer: DataPacker, choice: Choice) -> Choice:
    """``choice`` with the tool calls written in its text, parsed by ``packer``, as calls."""
    from runner.packers.chat import TOOL_CALL

    calls = [c for c in packer.parse_tool_calls(choice.text) if not c.error]
    if not calls:
        return choice
    content = TOOL_CALL.sub("", choice.text).strip() or None
    named = tuple((c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in calls)
    return attrs.evolve(choice, calls=named, content=content,
                        finish_reason="tool_calls" if choice.finish_reason == "stop"
                        else choice.finish_reason)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first of ``stops`` begins in ``text`` (None: none occurs)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None
