"""Multi-turn environments and tools (the recipe's ``[env]`` table).

An environment factory, named by dotted path like a dataset factory, is called as
``factory(**env.factory_kwargs)`` once per episode in the worker that plays it. Its object has:

- ``reset(item, seed) -> list[dict]``: the messages that open the episode (``item`` is the
  ``ObsBundle`` the data source gave; ``seed`` is the episode's own, the same on every run);
- ``step(messages) -> EnvStep``: called after every assistant turn with the whole conversation
  so far (its last message is the assistant's); returns the messages to append (role ``user``
  or ``tool``), this turn's reward, whether the episode is over, and numbers to log.

Tools (``env.tools``) are plain callables; see ``runner.envs.tools``. How an episode becomes
tokens, and which of them are trained, is ``runner.envs.episodes``. An agent written against the
OpenAI API (``env.agent``) plays its episodes itself: ``runner.envs.agents``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from runner.packers.chat import ToolCall

if TYPE_CHECKING:
    from runner.envs.episodes import EpisodeResult
    from runner.rollout.base import SamplingConfig
    from runner.types import ObsBundle


@attrs.frozen
class EnvStep:
    """The environment's answer to one assistant turn."""

    messages: list[dict[str, Any]] = attrs.field(factory=list)  # appended (role user or tool)
    reward: float = 0.0  # this turn's reward; an episode's env reward is the sum of its turns'
    done: bool = False
    info: dict[str, float] = attrs.field(factory=dict)  # numbers logged as env/NAME (means)


class EpisodePlayer(Protocol):
    """What plays a batch's episodes: ``EnvRunner`` (an environment and tools) or
    ``AgentRunner`` (an agent over the OpenAI API)."""

    def play(self, generate: Callable[..., list[Any]], check_tokens: Callable[..., None],
             items: Sequence[ObsBundle], params: SamplingConfig,
             seeds: Sequence[int] | None = None, step: int | None = None,
             max_len: int | None = None) -> list[EpisodeResult]:
        """``params.n`` episodes of each item (item-major), played to the end."""
        ...

    def describe(self) -> list[tuple[str, str]]:
        """What plays and with which tools, for the dry run."""
        ...

    def close(self) -> None: ...


__all__ = ["EnvStep", "EpisodePlayer", "ToolCall"]
