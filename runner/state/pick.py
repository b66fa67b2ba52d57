"""Which checkpoint a command reads, and whether its weights may be read at all: the
checkpoint ``export`` and ``eval`` pick (a step, or the newest intact one that fits), and the
refusal of pickled weights (weights load from safetensors only; nothing is unpickled)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from runner.errors import Problem, RecipeError, RuntimeFailure
from runner.state import integrity
from runner.state.layout import checkpoint_step, complete_checkpoints, step_dirname
from runner.state.load import CheckpointUnreadable, LoadedCheckpoint, load_checkpoint, load_latest
from runner.state.run_folder import pickled_weights


def refuse(what: str, hint: str = "", source: str = "export") -> RecipeError:
    """A command's refusal, one line naming ``what`` and ``hint`` (``source``: the command)."""
    return RecipeError([Problem("", what, hint=hint, source=source)])


def refuse_pickled(ckpt: LoadedCheckpoint) -> None:
    """A checkpoint's model loads from safetensors only: one whose weights were swapped for a
    pickle (``pytorch_model.bin``) is refused, never unpickled."""
    found = pickled_weights(ckpt.model_dir) if ckpt.model_dir.is_dir() else []
    if found:
        raise RuntimeFailure("resume", None, f"cannot load checkpoint {ckpt.path}: model/ holds "
                             f"pickled weights ({', '.join(found[:3])}) and no model.safetensors; "
                             "weights are loaded from safetensors only (nothing is unpickled)")


def pick_checkpoint(root: Path, step: int | None, source: str = "export",
                    fits: Callable[[LoadedCheckpoint], str] | None = None) -> LoadedCheckpoint:
    """The checkpoint under ``root`` (a run's checkpoints folder), intact and parsed: step
    ``step``, or the newest that is (as a resume picks it: damaged, unparsable or, by ``fits``
    (runner.state.fit), misfitting newer ones are passed over, saying why). ``source``: the
    command its errors name."""
    if step is None:
        found = load_latest(root, fits=fits) if root.is_dir() else None
        if found is None:
            raise refuse(f"{root.parent} has no complete checkpoint",
                          "train first, or give another run folder", source)
        return found
    folder = root / step_dirname(step)
    complete = complete_checkpoints(root) if root.is_dir() else []
    if folder not in complete:
        steps = [checkpoint_step(p) for p in complete]
        raise refuse(f"{root.parent} has no complete checkpoint of step {step}",
                      f"its checkpoints are of steps {steps}" if steps else "train first", source)
    reason = integrity.verify(folder)
    if reason:
        raise CheckpointUnreadable(folder, reason)
    loaded = load_checkpoint(folder)
    reason = fits(loaded) if fits is not None else ""
    if reason:
        raise CheckpointUnreadable(folder, reason)
    return loaded
