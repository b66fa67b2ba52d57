"""The build every program that runs the recipe's model shares: the model's folder, type and
codec, its DataPackers, the prompt limit, the engine and the rollout around it.

The training assembly (``runner.train.assembly.assemble``), the eval rank program
(``runner.eval.rank``) and the Ray rollout actor (``runner.launch.ray_roles``) build
these through the functions here, so an engine, a packer or a prompt limit is made one way
wherever a model runs. Each build step runs under ``BuildSteps``, which remembers the first
role that failed so that the ranks can stop together, naming it
(``runner.train.assembly.handshake``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from safetensors import SafetensorError

from runner.envs.build import build_env_runner
from runner.errors import RecipeError, RunnerError
from runner.packers.base import DataPacker
from runner.precision import Precision, shares_policy
from runner.ranks.context import RankContext
from runner.recipe.algos import spec_of
from runner.recipe.schema import Recipe
from runner.rollout.lengths import PromptLimit
from runner.state.fit import ModelShapes, misfit, shapes_of
from runner.train.assembly.streams import OpenedData, Streamed
from runner.train.roles import RoleProvider, Rollout, Trainable


class BuildSteps:
    """Runs the build in named roles, remembering the first that failed (and how)."""

    def __init__(self) -> None:
        self.failed: tuple[str, BaseException] | None = None

    def __call__(self, role: str, build: Callable[[], Any]) -> Any:
        if self.failed is not None:
            return None
        try:
            return build()
        except (RunnerError, RecipeError, OSError, ValueError, RuntimeError, ImportError) as exc:
            self.failed = (role, exc)
            return None


@attrs.frozen
class ModelFolder:
    """The recipe's model as every program reads it: its folder (a ``builtin:`` name built and
    resolved), its ``model_type`` and its codec (the tokenizer, or a vision-language model's
    processor). Tokenizer and packers always come from this base folder: training changes
    weights only."""

    path: Path
    model_type: str
    codec: Any


def open_model(recipe: Recipe, step: BuildSteps) -> ModelFolder | None:
    """The recipe's model folder, type and codec (None when a step failed)."""
    from runner.models import load_codec, read_model_type, resolve_model_path

    m = recipe.model
    path = step("policy", lambda: resolve_model_path(m.path))
    model_type = step("policy", lambda: m.model_type or read_model_type(path))
    codec = step("policy", lambda: load_codec(path, m.trust_remote_code))
    return ModelFolder(path, model_type, codec) if step.failed is None else None


def packer_for(recipe: Recipe, model: ModelFolder) -> DataPacker:
    """A fresh DataPacker for the recipe's model: ``data_packer.factory``'s, or the one the
    model_type registry picks (each role builds its own)."""
    from runner.packers import build_packer

    m = recipe.model
    return build_packer(model.path, model.model_type, recipe.data_packer.factory,
                        trust_remote_code=m.trust_remote_code, dtype=m.dtype)


def prompt_limit(recipe: Recipe, base: Path, packer: DataPacker, tokenizer: Any,
                 opened: OpenedData, streamed: Streamed, *, remote: bool) -> PromptLimit:
    """The engine's ``max_model_len`` and the check of every prompt that can be checked before
    the run (``runner.rollout.lengths.run_limit``). A Ray rollout actor sizes its engine
    without the prompts, so ranks that use one measure none."""
    from runner.rollout.lengths import run_limit

    sources, held_out = opened.prompts_to_check(streamed)
    return run_limit(recipe, base, packer, tokenizer, sources, held_out, measure=not remote)


def engine_for(recipe: Recipe, model_dir: Path, precision: Precision,
               limit: PromptLimit | None) -> Any:
    """The recipe's rollout engine (``rollout.engine``) over the weights in ``model_dir``, in
    the engine dtype ``precision`` chose, sized by ``limit`` (None: the engine's default)."""
    from runner.rollout.factory import make_engine

    return make_engine(recipe, model_dir, dtype=precision.engine_dtype,
                       max_model_len=limit.max_model_len if limit else None)


def serves_rollout(actors: RoleProvider | None) -> bool:
    """Whether the launcher serves the engine outside this rank (a Ray rollout actor)."""
    return bool(actors is not None and actors.rollout)


def rollout_for(recipe: Recipe, ctx: RankContext, actors: RoleProvider | None, model_dir: Path,
                precision: Precision, packer: DataPacker, limit: PromptLimit | None,
                policy: Trainable | None = None) -> Rollout:
    """This rank's rollout: the engine (this process's, or a handle on the launcher's rollout
    actor; an hf engine on ``policy``'s own module where ``shares_policy``), the rollout-side
    packer, the prompt limit and, with ``[env]``, the episode player."""
    if serves_rollout(actors):
        assert actors is not None
        engine = actors.rollout_engine(ctx)
    elif policy is not None and shares_policy(recipe, precision):
        from runner.models import load_tokenizer
        from runner.rollout.hf import HFEngine

        engine = HFEngine(policy.unwrapped(), load_tokenizer(
            str(model_dir), trust_remote_code=recipe.model.trust_remote_code),
            batch_size=recipe.rollout.batch_size,
            max_model_len=limit.max_model_len if limit else None, shares_weights=True)
    else:
        engine = engine_for(recipe, model_dir, precision, limit)
    return Rollout(engine, packer, limit, build_env_runner(recipe, packer))


def model_shapes(path: Path, dtype: str = "float32", trust_remote_code: bool = False,
                 head: str = "lm") -> ModelShapes:
    """The shapes of the model of folder ``path`` as a run builds it (with the trained model's
    ``head``, ``AlgoSpec.head``), read from an empty (meta) model: what a checkpoint of it must
    hold (``runner.state.fit``)."""
    from runner.models.loading import empty_causal_lm

    return shapes_of(empty_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                     head=head))


def recipe_check(recipe: Recipe) -> Callable[[Any], str]:
    """``check(loaded)`` for ``load_latest``: why a loaded checkpoint does not fit the recipe's
    model, or "" (the model's shapes are read once, on the first call)."""
    from runner.models import resolve_model_path

    m = recipe.model
    lora = m.lora.rank > 0

    @functools.cache
    def shapes() -> ModelShapes:
        return model_shapes(resolve_model_path(m.path), m.dtype, m.trust_remote_code,
                            spec_of(recipe).head)

    def check(loaded: Any) -> str:
        if lora:  # adapters, and an optimizer of the adapters alone: not checked here
            return ""
        try:
            return misfit(loaded.path, shapes())
        except (OSError, ValueError, KeyError, TypeError, AttributeError,
                SafetensorError) as exc:
            return f"{type(exc).__name__}: {exc}"

    return check
