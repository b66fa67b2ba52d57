"""``posttrain-run eval RECIPE [--checkpoint PATH | --checkpoint latest]``: what the ranks are
asked to evaluate, decided once by the driver.

The model is the recipe's (``model.path``, which an override can point at any model folder), or
a checkpoint of the recipe's run: ``latest`` is the newest intact one (as a resume picks it), a
path names one ``step-NNNNNN`` folder, which must be complete and intact
(``runner.eval.checkpoints``). The results go to ``run.output_dir/eval/<checkpoint or
model>/eval.json`` unless ``--out`` names a folder. A recipe without a held-out set, or a
checkpoint that is missing or damaged, is a one-line error (exit 2) before any rank starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from runner.errors import Problem, RecipeError, RunnerError
from runner.eval.checkpoints import SOURCE, find_checkpoint
from runner.recipe.algos import spec_of
from runner.recipe.held_out import held_out_reason
from runner.recipe.plan import RunPlan
from runner.recipe.schema import Recipe
from runner.state.run_folder import RunFolder, refuse_linked_folders

COMMAND = "eval"  # the job's name in the ranks' payload

# what an evaluation builds of a run's roles (no reference, critic or teacher)
EVAL_ROLES = ("driver", "policy", "rollout", "reward")


@attrs.frozen(kw_only=True)
class EvalJob:
    """What every rank of an evaluation does, decided by the driver (``eval_job``): the model it
    evaluates, where rank 0 writes ``eval.json`` and what that file keeps. It crosses to the
    ranks as plain data in their payload (``to_dict`` / ``from_dict``)."""

    checkpoint: Path | None  # the checkpoint folder (absolute); None: the recipe's model.path
    step: int | None  # that checkpoint's step (None for model.path)
    label: str  # the eval folder's name: the checkpoint folder's, or model-<model's name>
    out_dir: Path  # the folder eval.json goes to (absolute)
    save_completions: bool = False  # keep every completion's text in eval.json

    def to_dict(self) -> dict[str, Any]:
        """The job as the payload carries it (JSON): ``{"command": "eval", ...}``, the
        checkpoint "" for model.path."""
        return {"command": COMMAND, "checkpoint": str(self.checkpoint) if self.checkpoint else "",
                "step": self.step, "label": self.label, "out_dir": str(self.out_dir),
                "save_completions": self.save_completions}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EvalJob:
        """The job ``to_dict`` wrote; another command is refused."""
        if raw.get("command") != COMMAND:
            raise RunnerError(f"the ranks were given an unknown job {raw.get('command')!r}")
        return cls(checkpoint=Path(raw["checkpoint"]) if raw["checkpoint"] else None,
                   step=raw["step"], label=raw["label"], out_dir=Path(raw["out_dir"]),
                   save_completions=bool(raw["save_completions"]))


def eval_plan(plan: RunPlan) -> RunPlan:
    """The run's plan with only the roles an evaluation builds (Ray starts no frozen actor)."""
    return attrs.evolve(plan, roles=tuple(r for r in plan.roles if r in EVAL_ROLES))


def eval_job(recipe: Recipe, plan: RunPlan, *, checkpoint: str = "", out: str = "",
             save_completions: bool = False) -> EvalJob:
    """The job every rank runs: ``checkpoint`` ("latest", a checkpoint folder, or "" for
    ``model.path``) found and checked, and its output folder (``out``, or the run's
    ``eval/<label>``)."""
    spec = spec_of(recipe)
    if spec.head != "lm":
        raise RecipeError([Problem("algo.kind", "posttrain-run eval scores generated answers, and "
                                   f"the score head this run trains ({spec.title}) generates "
                                   "none; the run logs its held-out pair accuracy "
                                   "(eval/pair_accuracy)", got=recipe.algo.kind, source=SOURCE,
                                   hint="read metrics.jsonl, or load the exported folder with "
                                   "AutoModelForSequenceClassification")])
    reason = held_out_reason(recipe.data, spec.stream)
    if reason:
        raise RecipeError([Problem("data.validation", f"the recipe has no held-out set to "
                                   f"evaluate on ({reason})", source=SOURCE)])
    loaded = find_checkpoint(plan, checkpoint, recipe) if checkpoint else None
    label = loaded.path.name if loaded else f"model-{_slug(recipe.model.path)}"
    if not out:
        refuse_linked_folders(plan.output_dir, (f"eval/{label}",), key="", source=SOURCE)
    folder = Path(out) if out else RunFolder(plan.output_dir).eval(label)
    return EvalJob(checkpoint=loaded.path.resolve() if loaded else None,
                   step=loaded.state.step if loaded else None, label=label,
                   out_dir=folder.resolve(), save_completions=bool(save_completions))


def _slug(path: str) -> str:
    """A folder name for a model: its last path part (``builtin:NAME``: NAME)."""
    name = path.rstrip("/").replace("builtin:", "").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "model"
