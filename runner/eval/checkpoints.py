"""The checkpoint ``posttrain-run eval --checkpoint`` names, found and checked by the driver:
``latest`` is the run's newest intact one (as a resume picks it), a path one ``step-NNNNNN``
folder, complete and intact. Its model must load without unpickling anything and be the
recipe's: a checkpoint of another recipe's run is a one-line refusal naming both sides.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from runner.errors import Problem, RecipeError
from runner.recipe.plan import RunPlan
from runner.recipe.schema import Recipe
from runner.state.layout import MODEL_DIR, checkpoint_step
from runner.state.load import LoadedCheckpoint
from runner.state.run_folder import RunFolder

SOURCE = "eval"
_STEP_FOLDER = re.compile(r"step-\d+")


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

    path = RunFolder.of_checkpoint(ckpt).resolved
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
