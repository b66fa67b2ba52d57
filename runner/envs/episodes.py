"""Playing episodes: the engine writes the assistant's turns, the environment and the tools answer.

Each of a batch's items is played ``n`` times (a GRPO group is ``n`` episodes of one item), all
episodes of the batch turn by turn: every episode still going gets its next turn from one
engine call (one per distinct token budget), so the engine sees a batch as wide as a
single-turn rollout's. Per episode and turn:

1. the engine samples the assistant's turn from the episode's tokens so far, seeded by the
   episode (item position, sample) and the turn, so an episode is the same on any number of
   ranks and after a resume; the turn is cut to the episode's remaining ``env.max_total_tokens``;
2. the reply (decoded, special tokens dropped) joins the conversation as an assistant message;
3. a reply that calls one of ``env.tools`` is answered by the runner (one ``tool`` message per
   call); any other reply goes to the environment's ``step``;
4. unless the episode is over, the environment's messages are appended as the chat template
   renders them after the assistant's eos (``DataPacker.env_message_ids``).

An episode ends when the environment says done, or truncated: a turn cut by the token limit (no
eos), ``env.max_turns`` assistant turns, or no room left for the environment's answer and one
more token (an answer with more characters than the remaining tokens can spell is not even
rendered; a tool's result is first cut to the characters they can spell). Its tokens are the
prompt, then every turn's engine ids (trained: loss mask 1, the engine's logprobs) and the
environment's ids (mask 0, never trained); its text for the recipe's reward functions is its
last assistant reply; its env reward is the sum of its turns' rewards (each turn's, and the
sum, at most ``MAX_REWARD`` in magnitude).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from runner.envs import EnvStep
from runner.envs.tools import ToolBox, cut_text, run_with_timeout, tool_messages
from runner.errors import Problem, RecipeError, RuntimeFailure, show_value
from runner.packers.chat import NotAppendOnly
from runner.rewards.calls import MAX_REWARD
from runner.rollout.base import Completion, SamplingConfig, prompt_seeds
from runner.rollout.lengths import chars_per_token
from runner.types import ObsBundle

if TYPE_CHECKING:
    from runner.packers.base import DataPacker
    from runner.recipe.schema import EnvConfig

ROLES_FROM_ENV = ("user", "tool")
RUNNER_STATS = ("turns", "tool_calls", "tool_failures", "truncated", "reward")  # env/NAME: ours


@attrs.frozen
class EpisodeResult:
    """One finished episode, ready to join a trajectory."""

    prompt_ids: tuple[int, ...]
    completion: Completion  # every token after the prompt; text: the last assistant reply
    loss_mask: tuple[int, ...]  # per completion token: 1 for the engine's, 0 for the env's
    env_reward: float
    stats: dict[str, float]  # turns, tool_calls, tool_failures, truncated, and env info
    messages: tuple[dict[str, Any], ...]  # the conversation, for previews


@attrs.define
class _Episode:
    item: ObsBundle
    seed: int
    env: Any
    messages: list[dict[str, Any]]
    prompt_ids: tuple[int, ...]
    limit: int  # the most tokens it may reach (env.max_total_tokens within the engine's context)
    ids: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    mask: list[int] = attrs.Factory(list)
    last_reply: str = ""
    finish: str = "stop"
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    truncated: bool = False
    done: bool = False
    info: dict[str, float] = attrs.Factory(dict)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def result(self) -> EpisodeResult:
        stats = {"turns": float(self.turns), "tool_calls": float(self.tool_calls),
                 "tool_failures": float(self.tool_failures), "truncated": float(self.truncated),
                 **self.info}
        return EpisodeResult(self.prompt_ids, Completion(tuple(self.ids), self.last_reply,
                                                         tuple(self.logprobs), self.finish),
                             tuple(self.mask), self.reward, stats, tuple(self.messages))


class ToolEnv:
    """The built-in environment of ``env.tools`` without a factory: the item's prompt as the
    user's message; a reply that calls no tool ends the episode (its reward comes from the
    recipe's reward functions)."""

    def reset(self, item: ObsBundle, seed: int) -> list[dict[str, Any]]:
        if isinstance(item.prompt, list):
            return [dict(m) for m in item.prompt]
        return [{"role": "user", "content": str(item.prompt)}]

    def step(self, messages: list[dict[str, Any]]) -> EnvStep:
        return EnvStep(done=True)


def item_name(item: ObsBundle) -> str:
    """How errors name an item: its id, its row, or the start of its prompt."""
    if item.id:
        return f"item {item.id!r}"
    if item.origin.where:
        return item.origin.where
    text = str(item.prompt)
    return f"item {text[:60]!r}" + ("..." if len(text) > 60 else "")


def episode_seed(item_seed: int, sample: int) -> int:
    return (item_seed * 1_000_003 + sample * 7_919 + 1) % 2**63


def turn_seed(episode: int, turn: int) -> int:
    return (episode * 6_364_136_223 + turn * 1_442_695_041 + 11) % 2**63


class EnvRunner:
    """Plays a batch's episodes with one engine: built per worker from the recipe's ``[env]``."""

    def __init__(self, cfg: EnvConfig, packer: DataPacker, factory: Callable[..., Any] | None,
                 tools: ToolBox, model: str) -> None:
        self.cfg, self.packer, self.tools, self.model = cfg, packer, tools, model
        self.factory = factory or ToolEnv
        self.where = cfg.factory or "the built-in tool environment"
        # The most characters one token spells (None: no vocabulary to read), so that text the
        # remaining tokens cannot hold is never handed to the tokenizer.
        tokenizer = getattr(packer, "tokenizer", None)
        self.chars_per_token = (chars_per_token(tokenizer) if callable(
            getattr(tokenizer, "get_vocab", None)) else None)

    # --- the environment's calls, each checked ------------------------------------------------
    def _fail(self, step: int | None, item: ObsBundle, turn: int, what: str) -> RuntimeFailure:
        return RuntimeFailure("env", step, f"{self.where}: {what} ({item_name(item)}, turn "
                              f"{turn})")

    def _call(self, fn: Callable[[], Any], what: str, step: int | None, item: ObsBundle,
              turn: int) -> Any:
        timeout = self.cfg.step_timeout_s
        finished, value = run_with_timeout(fn, timeout)
        if not finished:
            raise self._fail(step, item, turn, f"{what} did not return within {timeout:g} s "
                             "(env.step_timeout_s)")
        if isinstance(value, BaseException):
            raise self._fail(step, item, turn, f"{what} raised {type(value).__name__}: {value}")
        return value

    def _new_env(self, step: int | None, item: ObsBundle) -> Any:
        env = self._call(lambda: self.factory(**self.cfg.factory_kwargs), "the factory", step,
                         item, 0)
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise self._fail(step, item, 0, f"the factory returned a {type(env).__name__}, "
                                 f"which has no {method}() method")
        return env

    def _messages(self, value: Any, what: str, roles: Sequence[str] | None, step: int | None,
                  item: ObsBundle, turn: int) -> list[dict[str, Any]]:
        ok = isinstance(value, list) and all(
            isinstance(m, dict) and isinstance(m.get("content"), str)
            and isinstance(m.get("role"), str) and (roles is None or m["role"] in roles)
            for m in value)
        if not ok:
            need = f"role {' or '.join(roles)}" if roles else "a role"
            raise self._fail(step, item, turn, f"{what} returned {_brief(value)}, not a list of "
                             f"messages {{'role': ..., 'content': str}} with {need}")
        return [dict(m) for m in value]

    def _step(self, ep: _Episode, step: int | None, turn: int) -> EnvStep:
        conversation = [dict(m) for m in ep.messages]
        out = self._call(lambda: ep.env.step(conversation), "step()", step, ep.item, turn)
        if not isinstance(out, EnvStep):
            raise self._fail(step, ep.item, turn, f"step() returned {_brief(out)}, not a "
                             "runner.envs.EnvStep")
        self._messages(out.messages, "step()", ROLES_FROM_ENV, step, ep.item, turn)
        reward = _finite(out.reward)
        if reward is None:
            raise self._fail(step, ep.item, turn, f"step() returned the reward "
                             f"{show_value(out.reward)}, not a finite number")
        if abs(reward) > MAX_REWARD:
            raise self._fail(step, ep.item, turn, f"step() returned the reward "
                             f"{show_value(out.reward)}, beyond the largest reward "
                             f"({MAX_REWARD:g} in magnitude)")
        if not _is_bool(out.done):
            raise self._fail(step, ep.item, turn, f"step() returned done = {_brief(out.done)}, "
                             "not a bool")
        if not isinstance(out.info, dict):
            raise self._fail(step, ep.item, turn, f"step() returned info = {_brief(out.info)}, "
                             "not a dict of numbers by name")
        for k, v in out.info.items():
            if not isinstance(k, str):
                raise self._fail(step, ep.item, turn, f"step() returned info with the key "
                                 f"{_brief(k)}, not a name (str)")
            if k in RUNNER_STATS:
                raise self._fail(step, ep.item, turn, f"step() returned info[{k!r}], a name the "
                                 f"runner logs itself (env/{k}); rename it")
            if not isinstance(v, numbers.Real):
                raise self._fail(step, ep.item, turn, f"step() returned info[{k!r}] = "
                                 f"{_brief(v)}, not a number")
            if _finite(v) is None:
                raise self._fail(step, ep.item, turn, f"step() returned info[{k!r}] = "
                                 f"{show_value(v)}, not a finite number")
        return out

    def _rendered(self, render: Callable[[], list[int]], item: ObsBundle, turn: int,
                  what: str) -> list[int]:
        """``render()``'s ids; a template that cannot render the messages (a role it does not
        know, say) is a RecipeError naming the model, the item and the turn."""
        try:
            return render()
        except (NotAppendOnly, RecipeError):
            raise
        except Exception as exc:  # noqa: BLE001 - templates raise what their authors chose
            raise RecipeError([Problem(
                "model.path", f"{self.model}: the chat template cannot render {what} at turn "
                f"{turn} of {item_name(item)}: {type(exc).__name__}: {exc}",
                hint="give the environment's messages roles the template knows (user, or tool "
                "where it renders tool messages), or use a DataPacker that renders them")]) from exc

    def describe(self) -> list[tuple[str, str]]:
        return [("environment", self.cfg.factory or "built-in tool environment"),
                ("tools", ", ".join(s["function"]["name"] for s in self.tools.schemas)
                 or "none")]

    def close(self) -> None:
        """Nothing of its own outlives a batch."""

    # --- episodes ----------------------------------------------------------------------------
    def start(self, item: ObsBundle, seed: int, step: int | None, limit: int) -> _Episode:
        """A new episode of ``item``: its environment made and reset, its opening rendered,
        within ``limit`` tokens."""
        env = self._new_env(step, item)
        opening = self._messages(self._call(lambda: env.reset(item, seed), "reset()", step,
                                            item, 0), "reset()", None, step, item, 0)
        if not opening:
            raise self._fail(step, item, 0, "reset() returned no messages")
        prompt = self._rendered(lambda: self.packer.render_messages(
            opening, self.tools.schemas or None, True), item, 0, "reset()'s messages")
        if len(prompt) >= limit:
            raise RecipeError([Problem("env.max_total_tokens", f"{item_name(item)}: the "
                                       f"episode's opening messages are {len(prompt)} tokens, "
                                       f"leaving no room for a reply within {limit}",
                                       got=self.cfg.max_total_tokens,
                                       hint="raise env.max_total_tokens (within the engine's "
                                       "context)")])
        return _Episode(item, seed, env, opening, tuple(int(t) for t in prompt), limit)

    def play(self, generate: Callable[..., list[Any]], check_tokens: Callable[..., None],
             items: Sequence[ObsBundle], params: SamplingConfig,
             seeds: Sequence[int] | None = None, step: int | None = None,
             max_len: int | None = None) -> list[EpisodeResult]:
        """``params.n`` episodes of each item (item-major), played to the end. ``generate`` is
        the engine's (prompts as token ids, sampling, seeds); ``check_tokens(n_prompt,
        max_new, item)`` refuses a prompt the engine cannot take; ``max_len`` is the engine's
        context (None: unknown), which an episode never outgrows (it ends truncated there)."""
        # An episode reaching the engine's context is truncated there.
        limit = min(self.cfg.max_total_tokens, max_len or self.cfg.max_total_tokens)
        item_seeds = prompt_seeds(params, len(items), seeds)
        episodes = [self.start(item, episode_seed(s, k), step, limit)
                    for item, s in zip(items, item_seeds, strict=True) for k in range(params.n)]
        for turn in range(self.cfg.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            self._generate(active, generate, check_tokens, params, turn)
            for ep in active:
                self._answer(ep, step, turn)
        return [e.result() for e in episodes]

    def _generate(self, active: list[_Episode], generate: Callable[..., list[Any]],
                  check_tokens: Callable[..., None], params: SamplingConfig, turn: int) -> None:
        """The next assistant turn of every active episode, one engine call per token budget."""
        budgets: dict[int, list[_Episode]] = {}
        for ep in active:
            budget = min(params.max_new_tokens, ep.limit - ep.length)
            budgets.setdefault(budget, []).append(ep)
        for budget, group in budgets.items():
            for ep in group:
                check_tokens(ep.length, budget, ep.item)
            outs = generate([list(ep.prompt_ids) + ep.ids for ep in group],
                            attrs.evolve(params, n=1, max_new_tokens=budget),
                            [turn_seed(ep.seed, turn) for ep in group])
            for ep, out in zip(group, outs, strict=True):
                c = out.completions[0]
                ids = [int(t) for t in c.token_ids]
                ep.ids += ids
                ep.logprobs += [float(x) for x in c.logprobs]
                ep.mask += [1] * len(ids)
                ep.turns += 1
                ep.finish = c.finish_reason
                eos = self.packer.eos_token_id
                ep.last_reply = self.packer.decode(ids[:-1] if ids and ids[-1] == eos else ids)
                ep.messages.append({"role": "assistant", "content": ep.last_reply})

    def _answer(self, ep: _Episode, step: int | None, turn: int) -> None:
        """The environment's (or the tools') answer to ``ep``'s last turn, appended unless the
        episode ends here."""
        if ep.finish != "stop":  # cut by the token budget: the reply is unfinished
            ep.truncated = ep.done = True
            return
        calls = self.packer.parse_tool_calls(ep.last_reply) if self.tools else []
        room = self._room(ep)
        if calls:
            new, failed = tool_messages(self.tools, calls)
            if room is not None:
                new = [{**m, "content": cut_text(m["content"], room)} for m in new]
            ep.tool_calls += len(calls)
            ep.tool_failures += failed
            done = False
        else:
            out = self._step(ep, step, turn)
            ep.reward += float(out.reward)
            if abs(ep.reward) > MAX_REWARD:
                raise self._fail(step, ep.item, turn, f"the episode's env reward (its turns' sum) "
                                 f"is {ep.reward:g}, beyond the largest reward ({MAX_REWARD:g} in "
                                 "magnitude)")
            for k, v in out.info.items():
                ep.info[k] = ep.info.get(k, 0.0) + float(v)
            new, done = [dict(m) for m in out.messages], bool(out.done)
        if done:
            ep.done = True
            return
        if turn + 1 >= self.cfg.max_turns or (
                room is not None and sum(len(m["content"]) for m in new) > room):
            ep.truncated = ep.done = True  # the last turn, or no room for the answer's text
            return
        try:
            ids = self._rendered(lambda: self.packer.env_message_ids(
                ep.messages, new, self.tools.schemas or None), ep.item, turn, "the answer")
        except NotAppendOnly as exc:
            raise RecipeError([Problem(
                "model.path", f"{self.model}: the chat template is not append-only at turn "
                f"{turn} of {item_name(ep.item)}: {exc}", hint="[env] needs a template that "
                "renders a longer conversation as the shorter one's tokens plus new ones; use "
                "another model, or a DataPacker whose env_message_ids renders the environment's "
                "messages itself")]) from exc
        if ep.length + len(ids) >= ep.limit:
            ep.truncated = ep.done = True
            return
        ep.messages += new
        ep.ids += ids
        ep.logprobs += [0.0] * len(ids)
        ep.mask += [0] * len(ids)

    def _room(self, ep: _Episode) -> int | None:
        """The most characters the episode's remaining tokens can spell (None: unknown)."""
        if self.chars_per_token is None:
            return None
        return max(0, ep.limit - ep.length) * self.chars_per_token


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (a string, NaN, inf, an integer beyond floats)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _is_bool(value: Any) -> bool:
    """A Python or a numpy boolean."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in
                                       ("bool_", "bool"))


def _brief(value: Any) -> str:
    return f"a {type(value).__name__} ({show_value(value)})"


def episode_stats(results: Sequence[EpisodeResult]) -> dict[str, float]:
    """Means over ``results`` of each episode number, as ``env/NAME``, and ``env/reward``."""
    if not results:
        return {}
    names = sorted({k for r in results for k in r.stats})
    n = len(results)
    out = {f"env/{k}": sum(r.stats.get(k, 0.0) for r in results) / n for k in names}
    out["env/reward"] = sum(r.env_reward for r in results) / n
    return out
