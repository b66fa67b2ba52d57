"""Multi-turn environments and tools (the recipe's ``[env]`` table).

An environment factory, named by dotted path like a dataset factory, is called as
``factory(**env.factory_kwargs)`` once per episode in the worker that plays it. Its object has:

- ``reset(item, seed) -> list[dict]``: the messages that open the episode (``item`` is the
  ``ObsBundle`` the data source gave; ``seed`` is the episode's own, the same on every run);
- ``step(messages) -> EnvStep``: called after every assistant turn with the whole conversation
  so far (its last message is the assistant's); returns the messages to append (role ``user``
  or ``tool``), this turn's reward, whether the episode is over, and numbers to log.

Tools (``env.tools``) are plain callables; see ``runner.envs.tools``. How an episode becomes
tokens, and which of them are trained, is ``runner.envs.episodes``.
"""

from __future__ import annotations

from typing import Any

import attrs

from runner.packers.chat import ToolCall


@attrs.frozen
class EnvStep:
    """The environment's answer to one assistant turn."""

    messages: list[dict[str, Any]] = attrs.field(factory=list)  # appended (role user or tool)
    reward: float = 0.0  # this turn's reward; an episode's env reward is the sum of its turns'
    done: bool = False
    info: dict[str, float] = attrs.field(factory=dict)  # numbers logged as env/NAME (means)


__all__ = ["EnvStep", "ToolCall"]
