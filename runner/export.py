"""``posttrain-run export RUN_DIR [--step N] OUT_DIR``: a run's trained policy as a Hugging Face
model folder that ``transformers`` and vLLM load like any other.

The checkpoint is the newest intact one of the run (or step ``N``, which must be intact too).
A full fine-tune's checkpoint already holds the weights; a LoRA run's holds adapters only, so
they are put on the base model named by the run's resolved recipe and merged into its weights
(W + (alpha / r) B A). The folder gets the base model's tokenizer or processor (with its chat
template) and generation config, and a model card (README.md) naming the recipe's hash, the
step and the held-out metrics logged at or before it. It is written beside ``OUT_DIR`` and
renamed into place when complete; an ``OUT_DIR`` that holds anything is refused.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from runner.errors import RuntimeFailure
from runner.models import load_codec, resolve_model_path
from runner.recipe import load_recipe
from runner.recipe.resolved import recipe_hash
from runner.recipe.schema import Recipe
from runner.state.load import LoadedCheckpoint
from runner.state.pick import pick_checkpoint, refuse
from runner.state.run_folder import RunFolder
from runner.train.assembly.build import recipe_check
from runner.train.roles.policy import checkpoint_policy


def export(run_dir: Path, out_dir: Path, step: int | None = None) -> Path:
    """Write the policy of ``run_dir``'s checkpoint (``step``, or the newest) to ``out_dir``;
    returns the checkpoint folder it came from."""
    if out_dir.is_symlink():
        raise refuse(f"{out_dir} is a symbolic link", "name a new folder (export never writes "
                      "through a symbolic link)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise refuse(f"{out_dir} exists and is not an empty folder",
                      "name a new folder (nothing is overwritten)")
    resolved = RunFolder(run_dir).resolved
    if not resolved.is_file():
        raise refuse(f"{run_dir} is not a run folder (it has no {resolved.name})",
                      "give the run.output_dir of a run")
    inside = checkpoints_above(out_dir, run_dir)
    if inside is not None:
        raise refuse(f"{out_dir} is inside a run's checkpoints folder ({inside}), whose "
                      "checkpoint rotation deletes what it holds",
                      "export to a folder outside any run's checkpoints/")
    recipe = load_recipe(resolved, [])
    loaded = pick_checkpoint(RunFolder(run_dir).checkpoints, step, fits=recipe_check(recipe))
    ckpt = loaded.path
    model = checkpoint_policy(recipe, ckpt)
    base = resolve_model_path(recipe.model.path)
    tmp = out_dir.parent / f".{out_dir.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(out_dir, tmp, recipe, loaded, model, base)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ckpt


def _write(out_dir: Path, tmp: Path, recipe: Recipe, loaded: LoadedCheckpoint, model: Any,
           base: Path) -> None:
    """The folder written at ``tmp`` and renamed to ``out_dir``; a failed write is one line
    naming ``out_dir`` (not the temporary folder beside it)."""
    ckpt = loaded.path
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        load_codec(base, recipe.model.trust_remote_code).save_pretrained(tmp)
        if (base / "generation_config.json").is_file():
            shutil.copyfile(base / "generation_config.json", tmp / "generation_config.json")
        (tmp / "README.md").write_text(model_card(recipe, loaded.state.step, loaded.metrics_rows,
                                                  ckpt), encoding="utf-8")
        if out_dir.is_dir() and not out_dir.is_symlink():
            out_dir.rmdir()  # empty, checked above
        tmp.rename(out_dir)
    except OSError as exc:
        raise RuntimeFailure("export", None, f"cannot write {out_dir}: "
                             f"{exc.strerror or exc} [errno {exc.errno}]") from exc


def checkpoints_above(out_dir: Path, run_dir: Path) -> Path | None:
    """The checkpoints folder of a run that ``out_dir`` lies in (links followed): ``run_dir``'s
    own, or any folder named ``checkpoints`` beside a run's resolved recipe. None if none."""
    target = out_dir.resolve()
    own = RunFolder(run_dir).checkpoints.resolve()
    for folder in (target, *target.parents):
        if folder == own or (folder.name == own.name
                             and RunFolder(folder.parent).resolved.is_file()):
            return folder
    return None


def model_card(recipe: Recipe, step: int, rows: list[dict[str, Any]], ckpt: Path) -> str:
    """A short README.md: what was trained, from what, how far, and how it scored."""
    held_out = next((row for row in reversed(rows) if row.get("step", 0) <= step
                     and any(k.startswith("eval/") for k in row)), None)
    lines = [f"# {recipe.run.name}", "",
             f"Trained with posttrain-runner: {recipe.algo.kind.upper()} from `{recipe.model.path}`"
             + (f" with LoRA rank {recipe.model.lora.rank} (merged)" if recipe.model.lora.rank
                else "") + f", step {step} (`{ckpt.name}`).", "",
             f"- recipe hash: `{recipe_hash(recipe)}`"]
    if held_out:
        lines.append(f"- held-out metrics at step {held_out['step']}:")
        lines += [f"  - `{k}`: {v:.6g}" for k, v in sorted(held_out.items())
                  if k.startswith("eval/") and isinstance(v, int | float)]
    else:
        lines.append("- no held-out metrics were logged")
    return "\n".join(lines) + "\n"
