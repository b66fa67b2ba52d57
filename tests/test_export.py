"""``posttrain-run export``: a run's policy as a Hugging Face folder that transformers and vLLM
load; LoRA adapters merged into the base weights (checked against W + (alpha / r) B A computed
here from the saved adapter tensors); refusals are one line with exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from runner.models import resolve_model_path
from runner.recipe import load_recipe
from runner.recipe.resolved import recipe_hash
from tests.conftest import REPO
from tests.resume_helpers import CLI, _env, run_cli

GRPO = "recipes/grpo-arith.toml"
SMALL = ("algo.prompts_per_step=4", "algo.group_size=4", "rollout.max_new_tokens=4",
         "data.validation.size=8", "train.eval_every=2", "checkpoint.every_steps=1",
         "logging.sample_every=0", "run.max_steps=3")
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "train.lr=3e-2")


def _export(*args: str):
    from tests import forkserver

    return forkserver.run([*CLI[:3], "export", *map(str, args)], cwd=REPO, env=_env(), timeout=300)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    done = run_cli(GRPO, out, *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_full_fine_tune_exports_its_weights_tokenizer_and_card(full_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    done = _export(full_run, out, "--step", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""  # no library progress bars
    ckpt = full_run / "checkpoints" / "step-000002" / "model"
    exported, saved = load_file(out / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "2 + 3 ="}],
                                        add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    assert model(ids).logits.isfinite().all()
    card = (out / "README.md").read_text()
    recipe = load_recipe(full_run / "recipe.resolved.toml", [])
    assert recipe_hash(recipe) in card and "step 2 (`step-000002`)" in card
    rows = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    at_2 = next(r for r in rows if r["step"] == 2 and "eval/reward" in r)
    assert f"`eval/reward`: {at_2['eval/reward']:.6g}" in card
    assert not list(tmp_path.glob(".model.export-*"))  # nothing left beside it


def test_refusals_are_one_line_and_write_nothing(full_run, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    cases = [((full_run, taken), f"export: {taken} exists and is not an empty folder"),
             ((full_run, tmp_path / "a", "--step", "7"),
              f"export: {full_run} has no complete checkpoint of step 7. Its checkpoints are "
              "of steps [2, 3]."),
             ((tmp_path, tmp_path / "b"), f"export: {tmp_path} is not a run folder")]
    for args, line in cases:
        done = _export(*args)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(line), done.stderr
    assert (taken / "keep.txt").read_text() == "mine" and len(list(taken.iterdir())) == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()



def test_an_export_into_checkpoints_or_a_link_is_refused(full_run, tmp_path):
    """Checkpoint rotation would delete an export inside checkpoints/ (the run's own, or
    another run's reached through a link); a link as OUT_DIR is refused, naming it, instead of
    'Not a directory' about a temporary folder."""
    step = full_run / "checkpoints" / "step-000003"
    empty, alias = tmp_path / "empty", tmp_path / "alias"
    empty.mkdir()
    (tmp_path / "link").symlink_to(empty)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    alias.symlink_to(full_run / "checkpoints")
    inside = "is inside a run's checkpoints folder ({}), whose checkpoint rotation deletes what it "
    cases = [((full_run, step / "exported"),
              f"export: {step / 'exported'} " + inside.format(full_run / "checkpoints")),
             ((full_run, alias / "exported"),
              f"export: {alias / 'exported'} " + inside.format(full_run / "checkpoints")),
             ((full_run, tmp_path / "link"), f"export: {tmp_path / 'link'} is a symbolic link. "
              "Name a new folder (export never writes through a symbolic link)."),
             ((full_run, tmp_path / "dangling"), f"export: {tmp_path / 'dangling'} is a "
              "symbolic link.")]
    for args, line in cases:
        done = _export(*args)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(line), done.stderr
    assert not (step / "exported").exists() and list(empty.iterdir()) == []
    assert not (tmp_path / "nowhere").exists()
    assert not list(tmp_path.glob(".*.export-*")) and not list(step.parent.glob(".*export*"))

@pytest.mark.slow
def test_lora_run_exports_merged_weights_that_vllm_and_transformers_load(tmp_path):
    """The exported weights equal the base weights plus (alpha / r) B A of the saved adapters
    (computed here, not by peft), and vLLM greedy-decodes like transformers from the folder."""
    run = tmp_path / "run"
    done = run_cli(GRPO, run, *SMALL, *LORA)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "model"
    done = _export(run, out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 3 (`step-000003`)" in (out / "README.md").read_text()
    base = load_file(resolve_model_path("builtin:tiny-arith") / "model.safetensors")
    adapters = load_file(run / "checkpoints" / "step-000003" / "model" /
                         "adapter_model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == base.keys()
    merged = 0
    for name, weight in base.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        a, b = adapters.get(f"{stem}.lora_A.weight"), adapters.get(f"{stem}.lora_B.weight")
        if a is None:
            assert torch.equal(exported[name], weight), name
            continue
        merged += 1
        expected = weight + (8 / 4) * (b @ a)
        assert torch.allclose(exported[name], expected, rtol=1e-6, atol=1e-7), name
        assert not torch.equal(exported[name], weight), name  # the adapters trained
    assert merged >= 4
    # posttrain-run eval of the LoRA checkpoint (adapters merged and pushed to the engine)
    # greedy-decodes the held-out prompts like the exported folder given as model.path.
    from tests.test_eval import _eval, _result

    texts = []
    for name, args in (("ckpt", ("--checkpoint", "latest", *LORA)),
                       ("exported", (f"model.path={out}",))):
        done = _eval(GRPO, f"run.output_dir={run}", *SMALL, *args, "--save-completions",
                     "--out", tmp_path / name)
        assert done.returncode == 0, done.stdout + done.stderr
        texts.append([it["completions"] for it in _result(tmp_path / name)["items"]])
    assert texts[0] == texts[1] and len(texts[0]) == 8

    pytest.importorskip("vllm")
    from runner.rollout.base import SamplingConfig
    from runner.rollout.hf import HFEngine
    from runner.rollout.vllm import VLLMEngine

    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    greedy = SamplingConfig(n=1, max_new_tokens=6, greedy=True)
    hf = HFEngine.from_path(str(out)).generate(prompts, greedy)
    engine = VLLMEngine(str(out), seed=0, max_model_len=128)
    try:
        vl = engine.generate(prompts, greedy)
    finally:
        engine.close()
    assert ([c.token_ids for o in vl for c in o.completions]
            == [c.token_ids for o in hf for c in o.completions])


@pytest.mark.slow
def test_vision_language_run_exports_its_processor(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    run = tmp_path / "run"
    done = run_cli("recipes/grpo-vl.toml", run, "run.max_steps=1", "algo.prompts_per_step=4",
                   "algo.group_size=4", "data.validation.enabled=false")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "model"
    done = _export(run, out)
    assert done.returncode == 0, done.stdout + done.stderr
    processor = AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "Qwen3VLProcessor" and processor.chat_template
    model = AutoModelForImageTextToText.from_pretrained(out)
    saved = load_file(run / "checkpoints" / "step-000001" / "model" / "model.safetensors")
    state = model.state_dict()
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    assert all(torch.equal(state[k], saved[k]) for k in saved)  # each loaded where it belongs
    assert "no held-out metrics were logged" in (out / "README.md").read_text()
