"""Compiled forwards (``train.compile``): a model's ``forward`` run through ``torch.compile``."""

from __future__ import annotations

import functools
from typing import Any

# Graphs one model class's forward may compile before torch runs further kinds of call eagerly
# (torch's default is 8): a run compiles a training, a scoring and generation's prefill and
# decoding graphs per model, and the policy, its engine, a reference and a teacher share the class.
RECOMPILE_LIMIT = 64


def generates_compiled(model: Any) -> bool:
    """Whether ``model``'s generation forwards are compiled too: a text model's. A vision-language
    model's generation keeps its image inputs and position state between calls and stays eager."""
    return getattr(getattr(model, "config", None), "vision_config", None) is None


def compile_forwards(model: Any, backend: str = "inductor") -> Any:
    """``train.compile``: ``model``'s forwards run through ``torch.compile(dynamic=True)``,
    compiled at their first call and again for a new kind of call (training, scoring without
    gradients, and for a text model generation's prefill and its decoding steps: one graph each,
    whatever the batch's width or the cache's length). A vision-language model's generation
    (forwards that keep a key/value cache) stays eager. ``backend``: torch.compile's (the tests
    trace with "eager", which runs the captured graph op by op)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)
    eager = model.forward
    compiled = torch.compile(eager, dynamic=True, backend=backend)
    generation = generates_compiled(model)

    @functools.wraps(eager)  # its signature: transformers reads which arguments forward takes
    def forward(*args: Any, **kwargs: Any) -> Any:
        cached = kwargs.get("use_cache") is not False
        return (compiled if generation or not cached else eager)(*args, **kwargs)

    model.forward = forward
    return model
