"""What the ``[train]`` table does to a model the run trains or scores with: dropout off,
gradient checkpointing, compiled forwards (``trained_model``; ``Frozen`` compiles its own,
``runner.models.compiled``)."""

from __future__ import annotations

from typing import Any

import torch

from runner.errors import Problem, RecipeError
from runner.models.compiled import compile_forwards
from runner.recipe.schema import TrainConfig


def disable_dropout(model: Any) -> Any:
    """Set every dropout probability of ``model`` to 0 (its ``nn.Dropout`` modules and the
    float ``attention_dropout`` of attention layers), so that the policy's logprobs in train
    mode equal the ones it had when the data was sampled. The config (saved with checkpoints)
    is left as it is."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


def checkpoint_activations(model: Any) -> Any:
    """Turn on ``model``'s gradient checkpointing (``train.gradient_checkpointing``): in a
    training forward each transformer layer keeps its input only and runs again in the backward
    pass (torch's non-reentrant checkpoint, which restores the RNG state, so the recomputation
    gives the same numbers). Eval-mode forwards (generation, scoring) are unchanged. A model
    class without transformers' support is a RecipeError naming it."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise RecipeError([Problem(
            "train.gradient_checkpointing",
            f"{type(model).__name__} does not support transformers' gradient checkpointing",
            hint="set train.gradient_checkpointing = false")])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def trained_model(model: Any, train: TrainConfig, called: Any = None) -> Any:
    """A model the run trains, as ``train`` asks: dropout off (``disable_dropout``), gradient
    checkpointing on (``gradient_checkpointing``), forwards compiled (``compile``): those of
    ``called``, the module the run calls (default ``model``; PPO's critic calls the backbone
    under the LM head)."""
    if train.disable_dropout:
        disable_dropout(model)
    if train.gradient_checkpointing:
        checkpoint_activations(model)
    if train.compile:
        compile_forwards(model if called is None else called)
    return model
