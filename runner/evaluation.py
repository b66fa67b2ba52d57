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
from runner.state.layout import MODEL_DIR, checkpoint_step
from runner.state.load import LoadedCheckpoint
from runner.state.run_folder import refuse_linked_folders

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
    loaded = find_checkpoint(plan, checkpoint, recipe) if checkpoint else None
    label = loaded.path.name if loaded else f"model-{_slug(recipe.model.path)}"
    if not out:
        refuse_linked_folders(plan.output_dir, (f"eval/{label}",), key="", source=SOURCE)
    folder = Path(out) if out else plan.output_dir / "eval" / label
    return {"command": "eval", "checkpoint": str(loaded.path.resolve()) if loaded else "",
            "step": loaded.state.step if loaded else None, "label": label,
            "out_dir": str(folder.resolve()), "save_completions": bool(save_completions)}


def find_checkpoint(plan: RunPlan, checkpoint: str, recipe: Recipe) -> LoadedCheckpoint:
    """``latest``: the run's newest intact checkpoint; a path: that checkpoint folder, complete
    and intact. Its model must load from safetensors (nothing is unpickled) and be the recipe's
    (``refuse_foreign``)."""
    from runner.state.pick import pick_checkpoint, refuse_pickled
    from runner.train.assembly.build import recipe_check

    if checkpoint == "latest":
        loaded = pick_checkpoint(plan.checkpoint_dir, None, SOURCE, recipe_check(recipe))
    else:
        folder = Path(checkpoint)
        if not _STEP_FOLDER.fullmatch(folder.name) or not folder.parent.is_dir():
            raise RecipeError([Problem("", f"{folder} is not a checkpoint folder",
                                       hint="give a step-NNNNNN folder under a run's "
                                       "checkpoints/, or --checkpoint latest", source=SOURCE)])
        loaded = pick_checkpoint(folder.parent, checkpoint_step(folder), SOURCE)
    refuse_pickled(loaded)
    refuse_foreign(recipe, loaded)
    return loaded


def refuse_foreign(recipe: Recipe, loaded: LoadedCheckpoint) -> None:
    """A checkpoint of another recipe's run is refused (a RecipeError naming both sides): its
    run's recipe (``recipe.resolved.toml`` beside ``checkpoints/``) trained another model (the
    ``[model]`` table: path, model_type, LoRA), its weights are not the recipe model's (names
    and shapes, runner.state.fit) or its tokenizer is not the recipe model's. The keys an
    evaluation may change (``eval.*``, the engine, the launch) change the recipe's hash, which
    is therefore named, not required to be equal."""
    from runner.models import read_model_type, resolve_model_path
    from runner.recipe.resolved import recipe_hash
    from runner.state.fit import misfit
    from runner.train.assembly.build import model_shapes

    ckpt, m = loaded.path, recipe.model
    mine = f"recipe hash {recipe_hash(recipe)[:12]}"
    theirs = _run_model(ckpt)
    if theirs is not None:
        ours = _unstructured(recipe)["model"]
        for key, value in ((k, ours.get(k)) for k in ("path", "model_type", "lora")):
            if theirs["model"].get(key) != value:
                raise _foreign(ckpt, f"its run trained model.{key} = {theirs['model'].get(key)!r} "
                               f"({theirs['hash']}) but the recipe has {value!r} ({mine})")
    base = resolve_model_path(m.path)
    config = ckpt / MODEL_DIR / "config.json"
    lora = m.lora.rank > 0
    if not lora and config.is_file():
        have = read_model_type(ckpt / MODEL_DIR, key="checkpoint")
        want = read_model_type(base)
        if have != want:
            raise _foreign(ckpt, f"it holds a {have!r} model but the recipe's model.path "
                           f"{m.path!r} is a {want!r} model")
    # a LoRA checkpoint holds adapters (and their optimizer): its base is model.path, above
    reason = misfit(ckpt, model_shapes(base, m.dtype, m.trust_remote_code)) if not lora else ""
    if reason:
        raise _foreign(ckpt, f"it does not fit the recipe's model.path {m.path!r}: {reason}")
    reason = _other_tokenizer(ckpt / MODEL_DIR, base, m.trust_remote_code)
    if reason:
        raise _foreign(ckpt, f"{reason} (model.path {m.path!r})")


def _foreign(ckpt: Path, why: str) -> RecipeError:
    return RecipeError([Problem("", f"checkpoint {ckpt} is not of this recipe: {why}",
                                hint="evaluate it with the recipe of the run that wrote it",
                                source=SOURCE)])


def _unstructured(recipe: Recipe) -> dict[str, Any]:
    from runner.recipe.resolved import resolved_document

    return resolved_document(recipe)


def _run_model(ckpt: Path) -> dict[str, Any] | None:
    """The ``[model]`` table and hash of the recipe of the run that wrote ``ckpt`` (None when its
    run folder has no readable recipe.resolved.toml)."""
    import tomllib

    from runner.recipe.resolved import RESOLVED_TABLE

    path = ckpt.parent.parent / "recipe.resolved.toml"
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model = doc.get("model")
    meta = doc.get(RESOLVED_TABLE)
    if not isinstance(model, dict):
        return None
    digest = meta.get("recipe_hash", "") if isinstance(meta, dict) else ""
    return {"model": model, "hash": f"recipe hash {str(digest)[:12]} in {path}"}


def _other_tokenizer(model_dir: Path, base: Path, trust: bool) -> str:
    """Why the tokenizer saved in a checkpoint's ``model/`` is not the base model's ("" when it
    is, or when the checkpoint saved none)."""
    from runner.models.loading import load_tokenizer

    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "vocab.json",
                                                          "tokenizer.model")):
        return ""
    try:
        have = load_tokenizer(model_dir, trust)
    except (OSError, ValueError, RecipeError) as exc:
        return f"its tokenizer does not load ({type(exc).__name__}: {exc})"
    want = load_tokenizer(base, trust)
    theirs, ours = have.get_vocab(), want.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))
        return (f"its tokenizer ({len(theirs)} tokens) is not the recipe model's ({len(ours)} "
                f"tokens; first difference: {differ[0][0]!r})")
    return ""


def _slug(path: str) -> str:
    """A folder name for a model: its last path part (``builtin:NAME``: NAME)."""
    name = path.rstrip("/").replace("builtin:", "").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "model"
