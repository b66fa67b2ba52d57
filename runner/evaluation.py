"""``posttrain-run eval RECIPE [--checkpoint PATH | --checkpoint latest]``: what the ranks are
asked to evaluate, decided once by the driver.

The model is the recipe's (``model.path``, which an override can point at any model folder), or
a checkpoint of the recipe's run: ``latest`` is the newest intact one (as a resume picks it), a
path names one ``step-NNNNNN`` folder, which must be complete and intact. The results go to
``run.output_dir/eval/<checkpoint or model>/eval.json`` unless ``--out`` names a folder. A
recipe without a held-out set, or a checkpoint that is missing or damaged, is a one-line error
(exit 2) before any rank starts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs

from runner.errors import Problem, RecipeError
from runner.recipe.algos import spec_of
from runner.recipe.held_out import held_out_reason
from runner.recipe.plan import RunPlan
from runner.recipe.schema import Recipe
from runner.state.checkpoint import LoadedCheckpoint, checkpoint_step

SOURCE = "eval"
_STEP_FOLDER = re.compile(r"step-\d+")


# what an evaluation builds of a run's roles (no reference, critic or teacher)
EVAL_ROLES = ("driver", "policy", "rollout", "reward")


def eval_plan(plan: RunPlan) -> RunPlan:
    """The run's plan with only the roles an evaluation builds (Ray starts no frozen actor)."""
    return attrs.evolve(plan, roles=tuple(r for r in plan.roles if r in EVAL_ROLES))


def eval_job(recipe: Recipe, plan: RunPlan, *, checkpoint: str = "", out: str = "",
             save_completions: bool = False) -> dict[str, Any]:
    """The job every rank runs (plain data): the checkpoint folder (absolute, "" for
    ``model.path``), its step, the output folder and its label, whether completions are kept."""
    reason = held_out_reason(recipe.data, spec_of(recipe).stream)
    if reason:
        raise RecipeError([Problem("data.validation", f"the recipe has no held-out set to "
                                   f"evaluate on ({reason})", source=SOURCE)])
    loaded = find_checkpoint(plan, checkpoint) if checkpoint else None
    label = loaded.path.name if loaded else f"model-{_slug(recipe.model.path)}"
    folder = Path(out) if out else plan.output_dir / "eval" / label
    return {"command": "eval", "checkpoint": str(loaded.path.resolve()) if loaded else "",
            "step": loaded.state.step if loaded else None, "label": label,
            "out_dir": str(folder.resolve()), "save_completions": bool(save_completions)}


def find_checkpoint(plan: RunPlan, checkpoint: str) -> LoadedCheckpoint:
    """``latest``: the run's newest intact checkpoint; a path: that checkpoint folder, complete
    and intact. Its model must load from safetensors (nothing is unpickled)."""
    from runner.export import pick_checkpoint
    from runner.train.assemble import refuse_pickled

    if checkpoint == "latest":
        loaded = pick_checkpoint(plan.checkpoint_dir, None, SOURCE)
    else:
        folder = Path(checkpoint)
        if not _STEP_FOLDER.fullmatch(folder.name) or not folder.parent.is_dir():
            raise RecipeError([Problem("", f"{folder} is not a checkpoint folder",
                                       hint="give a step-NNNNNN folder under a run's "
                                       "checkpoints/, or --checkpoint latest", source=SOURCE)])
        loaded = pick_checkpoint(folder.parent, checkpoint_step(folder), SOURCE)
    refuse_pickled(loaded)
    return loaded


def _slug(path: str) -> str:
    """A folder name for a model: its last path part (``builtin:NAME``: NAME)."""
    name = path.rstrip("/").replace("builtin:", "").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "model"
