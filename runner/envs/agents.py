"""Agents written against the OpenAI API, trained as they are (``[env] agent``).

The runner serves the policy on 127.0.0.1 while a batch plays (``runner.rollout.openai_server``)
and calls the user's agent once per episode as ``agent(item, client=OpenAI(base_url, api_key),
**env.agent_kwargs)``, each episode with a key of its own, so that every call is the episode's.
The agent returns its reward (a number, or a dict of named numbers that are summed), or None
(the recipe's ``[reward]`` functions score its last reply; they score it in every case).

Token-exact, by the ``[env]`` rule: a call's prompt is the chat template's rendering of its
messages. The first call's is the episode's prompt; a later call must send back the conversation
so far, the runner's answers unchanged, followed by new messages, whose tokens are the
template's difference (``DataPacker.env_message_ids``) appended after the engine's tokens: the
trained tokens are exactly the sampled ones. A call that rewrites the history (drops, edits or
summarises a message) is refused with a 409 and ends the episode as the agent's error.

Lockstep (deterministic): the engine runs when every live episode of the batch has a call
waiting or has ended, one call per token budget, each episode's turn seeded by (episode, call
index); so the episodes do not depend on thread timing, and a resumed run repeats them.
``rollout.server_batching = "continuous"`` runs it as soon as any call waits instead (the calls
that came in while it ran go together next), trading that for throughput. The
recipe's ``[rollout]`` sampling applies (a request's temperature, top_p and seed are not used:
they would make the engine's logprobs another policy's); its ``max_tokens`` may lower the turn's
budget. Episodes are played ``env.concurrency`` at a time.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import attrs
from fastapi import Request

from runner.envs.episodes import EpisodeResult, episode_seed, item_name, turn_seed
from runner.errors import RuntimeFailure
from runner.packers.chat import NotAppendOnly
from runner.rewards.calls import MAX_REWARD
from runner.rollout.base import Completion, SamplingConfig, prompt_seeds
from runner.rollout.openai_api import ApiError, ChatRequest, chat_body, chat_request, choices

if TYPE_CHECKING:
    from runner.packers.base import DataPacker
    from runner.recipe.schema import EnvConfig


@attrs.define(eq=False)
class _Call:
    request: ChatRequest
    answer: Future[dict[str, Any]] = attrs.Factory(Future)


@attrs.define(eq=False)
class _Session:
    item: Any
    seed: int
    key: str
    limit: int
    started: float = 0.0
    prompt_ids: tuple[int, ...] = ()
    ids: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    mask: list[int] = attrs.Factory(list)
    messages: list[dict[str, Any]] = attrs.Factory(list)
    tools: tuple[dict[str, Any], ...] = ()
    segments: list[int] = attrs.Factory(list)  # where in ids each later segment begins
    calls: int = 0
    tool_calls: int = 0
    last_reply: str = ""
    finish: str = "stop"
    pending: _Call | None = None
    done: bool = False  # no more calls are answered
    returned: bool = False  # the agent's function returned or raised
    truncated: bool = False
    value: Any = None
    error: str = ""
    timed_out: bool = False


def _same(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a message sent back is the one the conversation holds (ids aside)."""
    def calls(m: dict[str, Any]) -> list[tuple[str, Any]]:
        return [(c["function"]["name"], c["function"]["arguments"])
                for c in m.get("tool_calls") or ()]
    return (sent["role"] == kept["role"] and (sent.get("content") or "") ==
            (kept.get("content") or "") and calls(sent) == calls(kept))


class AgentRunner:
    """Plays a batch's episodes through the user's agent function; the same ``play`` as
    ``EnvRunner``'s, so the rollout takes either."""

    def __init__(self, cfg: EnvConfig, packer: DataPacker, agent: Callable[..., Any],
                 model: str, continuous: bool = False) -> None:
        self.cfg, self.packer, self.agent, self.model = cfg, packer, agent, model
        self.continuous = continuous  # rollout.server_batching
        self.where = cfg.agent
        self.sessions: dict[str, _Session] = {}
        self.lock = threading.Condition()
        self.server: Any = None
        self.http: Any = None  # the episodes' clients' connection pool
        self.tools_seen: tuple[dict[str, Any], ...] = ()  # the last first call's

    def describe(self) -> list[tuple[str, str]]:
        return [("agent", self.where), ("tools", ", ".join(
            t["function"]["name"] for t in self.tools_seen) or "none (as its calls sent)")]

    def close(self) -> None:
        """The endpoint stops (it starts again with the next batch)."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.http is not None:
            self.http.close()
            self.http = None

    # --- the endpoint ---------------------------------------------------------------------
    def _endpoint(self) -> Any:
        if self.server is None:
            from runner.rollout.openai_server import Background
            self.server = Background(self._app())
        return self.server

    def _app(self) -> Any:
        from runner.rollout.openai_server import CALLER, api_app, body_of

        app = api_app("posttrain-run agents", self.sessions.get,
                      "a valid episode key is needed: use the client the runner passed")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict[str, Any]:
            session: _Session = getattr(request.state, CALLER)
            req = chat_request(await body_of(request), self.cfg.max_total_tokens,
                               self.cfg.max_total_tokens)
            if req.sampling.n != 1 or req.sampling.stream or req.sampling.stop:
                raise ApiError(400, "n > 1, stream and stop are not served while an agent "
                               "trains (one completion per call, sampled as the recipe says)")
            call = _Call(req)
            with self.lock:
                if session.done:
                    raise ApiError(409, "this episode is over (its token or turn budget is "
                                   "spent, or its time)")
                session.pending = call
                self.lock.notify_all()
            return await asyncio.wrap_future(call.answer)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "object": "model",
                                                "owned_by": "posttrain-runner"}]}
        return app

    # --- episodes ---------------------------------------------------------------------------
    def play(self, generate: Callable[..., list[Any]], check_tokens: Callable[..., None],
             items: Sequence[Any], params: SamplingConfig, seeds: Sequence[int] | None = None,
             step: int | None = None, max_len: int | None = None) -> list[EpisodeResult]:
        """``params.n`` episodes of each item (item-major), ``env.concurrency`` at a time."""
        limit = min(self.cfg.max_total_tokens, max_len or self.cfg.max_total_tokens)
        item_seeds = prompt_seeds(params, len(items), seeds)
        sessions = [_Session(item, episode_seed(s, k), f"ep-{secrets.token_hex(16)}", limit)
                    for item, s in zip(items, item_seeds, strict=True) for k in range(params.n)]
        url = self._endpoint().url
        self._http()  # made here, before the agents' threads share it
        for first in range(0, len(sessions), self.cfg.concurrency):
            self._wave(sessions[first:first + self.cfg.concurrency], url, generate, check_tokens,
                       params, step)
        return [self._result(s, step) for s in sessions]

    def _wave(self, wave: list[_Session], url: str, generate: Callable[..., list[Any]],
              check_tokens: Callable[..., None], params: SamplingConfig, step: int | None
              ) -> None:
        with self.lock:
            self.sessions.update({s.key: s for s in wave})
        for s in wave:
            s.started = time.monotonic()
            threading.Thread(target=self._run_agent, args=(s, url), daemon=True,
                             name=f"agent {s.key[:10]}").start()
        def ready() -> bool:  # the engine runs (rollout.server_batching)
            if self.continuous:
                return any(s.pending and not s.done for s in wave) or all(s.done for s in wave)
            return all(s.done or s.pending for s in wave)

        try:
            while True:
                with self.lock:
                    self.lock.wait_for(ready, 0.2)
                    self._expire(wave)
                    if all(s.done and (s.returned or s.timed_out) for s in wave):
                        return
                    if not ready():
                        continue
                    batch = [s for s in wave if s.pending and not s.done]
                if batch:
                    self._serve(batch, generate, check_tokens, params, step)
        finally:
            with self.lock:
                for s in wave:
                    self.sessions.pop(s.key, None)

    def _expire(self, wave: list[_Session]) -> None:
        """Episodes past ``env.episode_timeout_s`` end (their agents' threads are left)."""
        now = time.monotonic()
        for s in wave:
            if not s.returned and not s.timed_out and \
                    now - s.started > self.cfg.episode_timeout_s:
                s.timed_out = s.done = True
                if s.pending is not None:
                    s.pending.answer.set_exception(ApiError(408, "the episode ran past "
                                                            "env.episode_timeout_s"))
                    s.pending = None

    def _http(self) -> Any:
        """One HTTP connection pool for every episode's client (making one per client costs
        more than the calls it serves). It ignores the environment's proxy settings: the
        endpoint is this process's own on 127.0.0.1, and an ``HTTP_PROXY`` (common on clusters)
        would otherwise get every call, the episode's key with it."""
        if self.http is None:
            import httpx

            self.http = httpx.Client(timeout=self.cfg.episode_timeout_s, trust_env=False,
                                     limits=httpx.Limits(max_connections=None,
                                                         max_keepalive_connections=256))
        return self.http

    def _run_agent(self, s: _Session, url: str) -> None:
        try:  # a node without the openai package: the episode's error, not a silent hang
            from openai import OpenAI

            client = OpenAI(base_url=url, api_key=s.key, max_retries=0,
                            timeout=self.cfg.episode_timeout_s, http_client=self._http())
            s.value = self.agent(s.item, client=client, **self.cfg.agent_kwargs)
        except BaseException as exc:  # noqa: BLE001 - the agent's own failure, reported
            s.error = s.error or f"raised {type(exc).__name__}: {exc}"
        finally:
            with self.lock:
                s.returned = s.done = True
                if s.pending is not None:  # cannot be: the agent waited on it
                    s.pending.answer.cancel()
                self.lock.notify_all()

    def _serve(self, batch: list[_Session], generate: Callable[..., list[Any]],
               check_tokens: Callable[..., None], params: SamplingConfig, step: int | None
               ) -> None:
        """One engine call per token budget for every waiting call of the batch."""
        budgets: dict[int, list[tuple[_Session, _Call, list[int]]]] = {}
        for s in batch:
            call = s.pending
            assert call is not None
            s.pending = None
            try:
                prompt = self._extend(s, call.request)
            except ApiError as exc:
                s.error, s.done = exc.message, True
                call.answer.set_exception(exc)
                continue
            # env.max_total_tokens bounds the episode's tokens, its segments together
            budget = min(params.max_new_tokens, call.request.sampling.max_tokens,
                         s.limit - len(s.prompt_ids) - len(s.ids))
            if budget < 1 or s.calls >= self.cfg.max_turns:
                s.truncated = s.done = True
                call.answer.set_exception(ApiError(409, "this episode's token or turn budget "
                                                   "is spent (env.max_total_tokens, "
                                                   "env.max_turns)"))
                continue
            check_tokens(len(prompt), budget, s.item)
            budgets.setdefault(budget, []).append((s, call, prompt))
        for budget, group in budgets.items():
            outs = generate([p for _, _, p in group], attrs.evolve(params, n=1,
                                                                   max_new_tokens=budget),
                            [turn_seed(s.seed, s.calls) for s, _, _ in group])
            for (s, call, prompt), out in zip(group, outs, strict=True):
                self._answered(s, call, prompt, out)

    def _extend(self, s: _Session, req: ChatRequest) -> list[int]:
        """The call's prompt ids, the session's tokens extended by its new messages; a call
        that rewrites the history starts a new segment (``env.on_rewrite = "split"``) or is
        refused."""
        messages = [dict(m) for m in req.messages]
        if s.calls == 0:
            s.prompt_ids = tuple(self.packer.render_messages(messages, list(req.tools) or None,
                                                             True))
            s.messages, s.tools = messages, req.tools
            self.tools_seen = req.tools
            return list(s.prompt_ids)
        kept = len(s.messages)
        if req.tools != s.tools or len(messages) <= kept or not all(
                _same(a, b) for a, b in zip(messages[:kept], s.messages, strict=True)):
            return self._rewritten(s, req, messages, f"call {s.calls + 1} does not send back "
                                   "the conversation so far followed by new messages (a message "
                                   "was changed, dropped or the tools changed)")
        new = messages[kept:]
        try:
            ids = self.packer.env_message_ids(s.messages, new, list(s.tools) or None)
        except NotAppendOnly as exc:
            return self._rewritten(s, req, messages,
                                   f"the chat template is not append-only here: {exc}")
        s.messages = messages
        s.ids += ids
        s.logprobs += [0.0] * len(ids)
        s.mask += [0] * len(ids)
        return self._context(s)

    def _context(self, s: _Session) -> list[int]:
        """What the engine is prompted with: the current segment's tokens so far."""
        if not s.segments:
            return list(s.prompt_ids) + s.ids
        return s.ids[s.segments[-1]:]

    def _rewritten(self, s: _Session, req: ChatRequest, messages: list[dict[str, Any]],
                   why: str) -> list[int]:
        """A call whose prompt does not extend the episode's tokens: with ``on_rewrite =
        "split"`` a new segment, its prompt the template's rendering of the call's messages
        (untrained, after the tokens so far, attending to itself only), else a 409."""
        if self.cfg.on_rewrite != "split":
            raise ApiError(409, f"{why}: the episode's trained tokens must be the ones sampled "
                           "(env.on_rewrite = 'split' trains such a call as a new segment)")
        prompt = self.packer.render_messages(messages, list(req.tools) or None, True)
        s.segments.append(len(s.ids))
        s.messages, s.tools = messages, req.tools
        s.ids += prompt
        s.logprobs += [0.0] * len(prompt)
        s.mask += [0] * len(prompt)
        return self._context(s)

    def _answered(self, s: _Session, call: _Call, prompt: list[int], out: Any) -> None:
        sampling = call.request.sampling
        [choice] = choices(self.packer, out, attrs.evolve(sampling, stop=()), chat=True,
                           tools=bool(s.tools))
        c: Completion = out.completions[0]
        s.ids += [int(t) for t in c.token_ids]
        s.logprobs += [float(x) for x in c.logprobs]
        s.mask += [1] * len(c.token_ids)
        s.calls += 1
        s.tool_calls += len(choice.calls)
        s.last_reply, s.finish = choice.text, c.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": choice.content or ""}
        if choice.calls:
            import json

            message["tool_calls"] = [{"type": "function", "function": {
                "name": name, "arguments": json.loads(args)}} for name, args in choice.calls]
        s.messages.append(message)
        if c.finish_reason != "stop":
            s.truncated = s.done = True
        body = chat_body(f"chatcmpl-{s.key[-8:]}-{s.calls}", int(time.time()), self.model,
                         prompt, [choice], sampling.logprobs)
        call.answer.set_result(body)

    def _result(self, s: _Session, step: int | None) -> EpisodeResult:
        reward, named = self._reward(s, step)
        stats = {"turns": float(s.calls), "tool_calls": float(s.tool_calls),
                 "tool_failures": 0.0, "truncated": float(s.truncated),
                 "agent_error": float(bool(s.error)), "agent_timeout": float(s.timed_out),
                 "rewrites": float(len(s.segments)),
                 **{f"agent_{k}": v for k, v in named.items()}}
        if not s.prompt_ids:  # the agent never asked the model: nothing to train
            prompt = self.packer.render_messages([{"role": "user", "content": str(
                s.item.prompt)}], None, True)
            eos = self.packer.eos_token_id
            return EpisodeResult(tuple(prompt), Completion((eos,), "", (0.0,), "stop"), (0,),
                                 reward, stats, ())
        return EpisodeResult(s.prompt_ids, Completion(tuple(s.ids), s.last_reply,
                                                      tuple(s.logprobs), s.finish,
                                                      tuple(s.segments)),
                             tuple(s.mask), reward, stats, tuple(s.messages))

    def _reward(self, s: _Session, step: int | None) -> tuple[float, dict[str, float]]:
        """The agent's reward (0 for an episode that failed, under ``on_agent_error = zero``)."""
        failed = s.error or ("ran past env.episode_timeout_s" if s.timed_out else "")
        if s.truncated and not s.timed_out:  # what it did once its budget was spent is ours
            failed = ""
            if s.error:
                return 0.0, {}
        if failed:
            if self.cfg.on_agent_error == "fail":
                raise RuntimeFailure("env", step, f"{self.where}: {failed} "
                                     f"({item_name(s.item)})")
            return 0.0, {}
        value = s.value
        named = dict(value) if isinstance(value, dict) else {}
        try:
            total = (0.0 if value is None else sum(float(v) for v in named.values()) if named
                     else float(value))
            named = {str(k): float(v) for k, v in named.items()}
        except (TypeError, ValueError) as exc:
            raise RuntimeFailure("env", step, f"{self.where}: returned {value!r}, not a "
                                 f"number, a dict of numbers or None ({item_name(s.item)})"
                                 ) from exc
        if not abs(total) <= MAX_REWARD:
            raise RuntimeFailure("env", step, f"{self.where}: returned the reward {total:g}, "
                                 f"not a finite number of at most {MAX_REWARD:g} in magnitude "
                                 f"({item_name(s.item)})")
        return total, named
