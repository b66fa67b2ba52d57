"""Checkpoints whose files are whole but do not fit the model: a tensor reshaped or removed, an
optimizer slot of another shape (the DDP file or an FSDP rank's shard), with the manifest
rebuilt to match so that it verifies. Resume passes such a checkpoint over like an unparsable
one, naming the file and the tensor; ``eval`` refuses another recipe's checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.recipe import load_recipe
from runner.state import integrity
from runner.state.fit import optimizer_misfit
from runner.state.layout import COMPLETE
from runner.state.load import load_latest
from runner.train.assembly.build import model_shapes, recipe_check
from tests.conftest import REPO
from tests.resume_helpers import run_cli

RECIPE = "recipes/grpo-arith.toml"
SMALL = ("algo.prompts_per_step=2", "algo.group_size=2", "algo.minibatches=1",
         "rollout.max_new_tokens=3", "data.validation.size=4", "train.eval_every=0",
         "checkpoint.every_steps=1", "checkpoint.keep_last=3", "logging.sample_every=0")
TENSOR = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A grpo-arith run of 2 steps with a checkpoint of each."""
    out = tmp_path_factory.mktemp("fit") / "run"
    done = run_cli(RECIPE, out, "run.max_steps=2", *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _copy(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out, ignore=shutil.ignore_patterns("run.lock"))
    return out


def _rewrite(folder: Path, rel: str, change) -> None:
    """Change the tensors of ``folder/rel`` and rebuild the manifest, as a hostile edit would."""
    tensors = load_file(folder / rel)
    change(tensors)
    save_file(tensors, folder / rel, metadata={"format": "pt"})
    integrity.write_manifest(folder, int(folder.name.split("-")[1]), skip=(COMPLETE,))
    assert integrity.verify(folder) == ""


def _reshape(tensors: dict) -> None:
    tensors[TENSOR] = torch.zeros(tensors[TENSOR].shape[0], tensors[TENSOR].shape[1] + 1)


def _drop(tensors: dict) -> None:
    del tensors[TENSOR]


def _resume(out: Path):
    return run_cli(RECIPE, out, "run.max_steps=2", *SMALL)


@pytest.mark.slow
@pytest.mark.parametrize(("rel", "change", "reason"), [
    ("model/model.safetensors", _reshape,
     f"model/model.safetensors: tensor {TENSOR!r} has shape [{{a}}, {{b}}] where the model has "
     "[{a}, {c}]"),
    ("model/model.safetensors", _drop, f"model: the model's tensor {TENSOR!r} is missing"),
    ("optimizer.safetensors", lambda t: t.update({"3.exp_avg": torch.zeros(2, 3)}),
     "optimizer.safetensors: tensor '3.exp_avg' (exp_avg of {name3}) has shape [2, 3] where "
     "the parameter has {shape3}"),
], ids=["reshaped", "missing", "optimizer"])
def test_a_misfitting_checkpoint_is_passed_over_on_resume(trained, tmp_path, rel, change,
                                                          reason):
    out = _copy(trained, tmp_path)
    newest = out / "checkpoints" / "step-000002"
    before = load_file(newest / "model" / "model.safetensors")[TENSOR].shape
    _rewrite(newest, rel, change)
    params = dict(enumerate(_optimizer_params()))
    name3, shape3 = params[3]
    expected = reason.format(a=before[0], b=before[1] + 1, c=before[1], name3=name3,
                             shape3="[" + ", ".join(map(str, shape3)) + "]")
    done = _resume(out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"cannot load checkpoint {newest}: {expected}; skipping it" in done.stdout, done.stdout
    assert f"from {out / 'checkpoints' / 'step-000001'} (step 1)" in done.stdout
    assert "Traceback" not in done.stderr
    # the step retrained from step 1 replaced the misfit: its tensors have the model's shapes
    assert load_file(newest / "model" / "model.safetensors")[TENSOR].shape == before
    assert integrity.verify(newest) == ""


def _optimizer_params() -> list[tuple[str, tuple[int, ...]]]:
    from runner.models import resolve_model_path

    return list(model_shapes(resolve_model_path("builtin:tiny-arith")).optimizer)


@pytest.mark.slow
def test_no_checkpoint_that_fits_stops_the_run(trained, tmp_path):
    out = _copy(trained, tmp_path)
    for step in (1, 2):
        _rewrite(out / "checkpoints" / f"step-00000{step}", "model/model.safetensors", _reshape)
    done = _resume(out)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: resume: no intact checkpoint in {out / 'checkpoints'} ("
                               f"step-000002: model/model.safetensors: tensor {TENSOR!r} has "
                               "shape"), lines


def test_load_latest_passes_a_misfit_over(trained, tmp_path):
    out = _copy(trained, tmp_path)
    newest = out / "checkpoints" / "step-000002"
    _rewrite(newest, "model/model.safetensors", _drop)
    recipe = load_recipe(REPO / RECIPE, [f"run.output_dir={out}"])
    said: list[str] = []
    found = load_latest(out / "checkpoints", said.append, fits=recipe_check(recipe))
    assert found is not None and found.path == out / "checkpoints" / "step-000001"
    assert said == [f"cannot load checkpoint {newest}: model: the model's tensor {TENSOR!r} is "
                    "missing; skipping it"]


def _sharded(folder: Path, params: list[tuple[str, tuple[int, ...]]], world: int = 2) -> None:
    """An FSDP checkpoint's optimizer as runner.train.roles.sharding writes it: each rank's rows of
    every parameter's Adam moments (Shard(0)), the step replicated, and the index."""
    files = [f"optimizer-rank-{r:05d}-of-{world:05d}.safetensors" for r in range(world)]
    for rank, name in enumerate(files):
        tensors = {}
        for i, (_, shape) in enumerate(params):
            rows = torch.zeros(shape).chunk(world)
            part = rows[rank] if rank < len(rows) else torch.zeros(0, *shape[1:])
            tensors[f"{i}.exp_avg"] = part.contiguous()
            tensors[f"{i}.exp_avg_sq"] = part.clone().contiguous()
            tensors[f"{i}.step"] = torch.tensor(2.0)
        save_file(tensors, folder / name)
    layout = {str(i): {"exp_avg": "sharded", "exp_avg_sq": "sharded", "step": "replicated"}
              for i in range(len(params))}
    index = {"param_groups": [], "state": layout, "files": files,
             "params": {str(i): {"name": n, "shape": list(s)} for i, (n, s) in enumerate(params)}}
    (folder / "optimizer.json").write_text(json.dumps(index))


def test_an_fsdp_rank_shard_of_another_shape_is_named(tmp_path):
    from runner.models import resolve_model_path

    shapes = model_shapes(resolve_model_path("builtin:tiny-arith"))
    params = list(shapes.optimizer)
    _sharded(tmp_path, params)
    assert optimizer_misfit(tmp_path, shapes) == ""
    shard = tmp_path / "optimizer-rank-00001-of-00002.safetensors"
    tensors = load_file(shard)
    name, shape = params[5]
    tensors["5.exp_avg"] = torch.zeros(tensors["5.exp_avg"].shape[0] + 1, *shape[1:])
    save_file(tensors, shard)
    rows = -(-shape[0] // 2) + (shape[0] - -(-shape[0] // 2)) + 1
    assert optimizer_misfit(tmp_path, shapes) == (
        f"optimizer-rank-*: the ranks' parts of '5.exp_avg' ({name}) have {rows} rows in 2 "
        f"file(s) where the parameter has {shape[0]}")
    tensors["5.exp_avg"] = torch.zeros(1, 3)
    save_file(tensors, shard)
    assert optimizer_misfit(tmp_path, shapes).startswith(
        "optimizer-rank-00001-of-00002.safetensors: tensor '5.exp_avg' (exp_avg of "
        f"{name}) has shape [1, 3], not a part of the parameter's")


def test_an_fsdp_index_naming_other_parameters_is_named(tmp_path):
    from runner.models import resolve_model_path

    shapes = model_shapes(resolve_model_path("builtin:tiny-arith"))
    params = list(shapes.optimizer)
    name, shape = params[2]
    params[2] = (name, (shape[0] * 2, *shape[1:]))
    _sharded(tmp_path, params)
    assert optimizer_misfit(tmp_path, shapes) == (
        f"optimizer.json: parameter 2 is {name!r} of shape [{shape[0] * 2}] where the model has "
        f"{name!r} of shape [{shape[0]}]")


def test_every_builtin_checkpoint_fits_its_model(tmp_path):
    """What save_pretrained writes fits the model it was written from (a vision-language
    model's keys are renamed on load: compared after that renaming)."""
    from runner.models import load_causal_lm, resolve_model_path
    from runner.state.fit import model_misfit

    for name in ("builtin:tiny-arith", "builtin:tiny-qwen3-vl"):
        base = resolve_model_path(name)
        folder = tmp_path / name.split(":")[1] / "model"
        load_causal_lm(base).save_pretrained(folder)
        assert model_misfit(folder, model_shapes(base)) == "", name
    vl = tmp_path / "tiny-qwen3-vl" / "model"
    assert model_misfit(vl, model_shapes(resolve_model_path("builtin:tiny-arith"))).startswith(
        "model/model.safetensors: tensor 'model.language_model.")


def _eval(*args: object):
    from tests import forkserver
    from tests.resume_helpers import CLI, _env

    return forkserver.run([*CLI[:3], "eval", "--plain", *map(str, args)], cwd=REPO, env=_env(),
                          timeout=300)


def _foreign_model(newest: Path, name: str) -> None:
    """Put builtin ``name``'s weights and tokenizer (or processor) into checkpoint ``newest``
    in place of its own, and rebuild its manifest."""
    from runner.models import load_causal_lm, load_codec, resolve_model_path

    base = resolve_model_path(name)
    shutil.rmtree(newest / "model")
    load_causal_lm(base).save_pretrained(newest / "model")
    load_codec(base).save_pretrained(newest / "model")
    integrity.write_manifest(newest, 2, skip=(COMPLETE,))


@pytest.mark.slow
def test_eval_refuses_another_recipes_checkpoint(trained, tmp_path):
    out = _copy(trained, tmp_path)
    newest = out / "checkpoints" / "step-000002"
    _foreign_model(newest, "builtin:tiny-qwen3-vl")
    resolved = out / "recipe.resolved.toml"
    resolved.write_text(resolved.read_text().replace('path = "builtin:tiny-arith"',
                                                     'path = "builtin:tiny-qwen3-vl"', 1))
    prefix = f"eval: checkpoint {newest} is not of this recipe: "
    done = _eval(RECIPE, *SMALL, "--checkpoint", newest)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(
        f"{prefix}its run trained model.path = 'builtin:tiny-qwen3-vl' (recipe hash "), \
        done.stderr
    assert f"in {resolved}) but the recipe has 'builtin:tiny-arith' (recipe hash " \
        in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    resolved.unlink()  # a checkpoint copied out of its run: its files still tell
    done = _eval(RECIPE, *SMALL, "--checkpoint", newest)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        f"{prefix}it holds a 'qwen3_vl' model but the recipe's model.path "
        "'builtin:tiny-arith' is a 'qwen2' model. Evaluate it with the recipe of the run that "
        "wrote it.")


@pytest.mark.slow
def test_eval_refuses_a_checkpoint_of_another_tokenizer(trained, tmp_path):
    from runner.models import load_codec, resolve_model_path

    out = _copy(trained, tmp_path)
    newest = out / "checkpoints" / "step-000002"
    load_codec(resolve_model_path("builtin:tiny-arith-char")).save_pretrained(newest / "model")
    integrity.write_manifest(newest, 2, skip=(COMPLETE,))
    done = _eval(RECIPE, *SMALL, "--checkpoint", newest)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"eval: checkpoint {newest} is not of this recipe: its "
                                  "tokenizer ("), done.stderr
    assert "is not the recipe model's (" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_eval_refuses_a_reshaped_checkpoint(trained, tmp_path):
    out = _copy(trained, tmp_path)
    newest = out / "checkpoints" / "step-000002"
    _rewrite(newest, "model/model.safetensors", _reshape)
    done = _eval(RECIPE, *SMALL, "--checkpoint", newest)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"eval: checkpoint {newest} is not of this recipe: it does not fit the "
            f"recipe's model.path 'builtin:tiny-arith': model/model.safetensors: tensor "
            f"{TENSOR!r} has shape") in done.stderr, done.stderr
