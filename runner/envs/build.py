"""The recipe's ``[env]`` as the objects a worker plays episodes with (each builds its own)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runner.envs.tools import ToolBox
from runner.errors import Problem, RecipeError
from runner.extensions import check_binds, load_callable
from runner.recipe.rules import env_enabled

if TYPE_CHECKING:
    from runner.envs import EpisodePlayer
    from runner.packers.base import DataPacker
    from runner.recipe.schema import EnvConfig, Recipe


def load_tools(cfg: EnvConfig) -> dict[str, Callable[..., Any]]:
    """``env.tools`` by name (each callable's ``__name__``, else its path's last part)."""
    tools: dict[str, Callable[..., Any]] = {}
    for i, dotted in enumerate(cfg.tools):
        fn = load_callable(dotted, key=f"env.tools[{i}]")
        name = getattr(fn, "__name__", "") or dotted.rsplit(".", 1)[-1]
        if name in tools:
            raise RecipeError([Problem(f"env.tools[{i}]", f"{dotted}: a second tool named "
                                       f"{name!r}; the model calls tools by name",
                                       hint="rename one of them")])
        tools[name] = fn
    return tools


def load_factory(cfg: EnvConfig) -> Callable[..., Any] | None:
    """``env.factory``, checked to bind ``env.factory_kwargs`` (None: the built-in one)."""
    if not cfg.factory:
        return None
    fn = load_callable(cfg.factory, key="env.factory")
    check_binds(fn, cfg.factory, key="env.factory", kwargs=cfg.factory_kwargs)
    return fn


def build_env_runner(recipe: Recipe, packer: DataPacker) -> EpisodePlayer | None:
    """The worker's episode player for ``recipe`` with the rollout-side ``packer``; None for
    single-turn rollouts."""
    if not env_enabled(recipe):
        return None
    from runner.envs.episodes import EnvRunner

    if not packer.renders_chat:
        raise RecipeError([Problem(
            "data_packer.factory" if recipe.data_packer.factory else "model.path",
            f"{type(packer).__name__} does not render chat conversations (renders_chat is "
            "false), which [env] episodes are made of", got=recipe.data_packer.factory
            or recipe.model.path, hint="use a text model with a chat template, or a packer "
            "whose render_messages renders them (and renders_chat = True)")])
    cfg = recipe.env
    if cfg.agent:
        from runner.envs.agents import AgentRunner

        agent = load_callable(cfg.agent, key="env.agent")
        return AgentRunner(cfg, packer, agent, recipe.model.path,
                           continuous=recipe.rollout.server_batching == "continuous")
    return EnvRunner(cfg, packer, load_factory(cfg), ToolBox(load_tools(cfg), cfg.tool_timeout_s),
                     recipe.model.path)
