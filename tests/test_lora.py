"""LoRA through peft: only the adapters train and are checkpointed, the engine receives the
merged weights under the base model's names, and a stopped run resumes exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from runner.recipe.schema import LoraConfig
from runner.train.roles.lora import apply_lora, load_adapters, merged_weights, trainable_share
from tests.resume_helpers import assert_same_run, final_weights, rows, run_cli


@pytest.fixture
def base():
    from runner.models import load_causal_lm

    return load_causal_lm("builtin:tiny-arith")


def _perturb_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def test_fresh_adapters_leave_the_model_as_it_was_and_only_they_train(base):
    original = {n: p.detach().clone() for n, p in base.named_parameters()}
    state = torch.random.get_rng_state()
    model = apply_lora(base, LoraConfig(rank=4, alpha=8.0), seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # own generator: global RNG untouched
    merged = dict(merged_weights(model))
    assert merged.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(merged[name], value), name  # B = 0
    n, total = trainable_share(model)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in name for name in trainable)
    assert 0 < n < total


def test_merged_weights_equal_peft_merge(base):
    model = apply_lora(base, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), 0)
    _perturb_adapters(model)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    merged = dict(merged_weights(model))
    from runner.models import load_causal_lm

    fresh = dict(load_causal_lm("builtin:tiny-arith").named_parameters())
    changed = {name for name in merged if not torch.equal(merged[name], fresh[name])}
    assert changed and all(".q_proj." in n or ".v_proj." in n for n in changed)
    for name, value in merged.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-7)
    adapted = [name for name in merged if ".q_proj." in name or ".v_proj." in name]
    assert adapted and all(name.endswith((".weight", ".bias")) for name in adapted)


def test_adapters_round_trip_through_their_folder(base, tmp_path):
    from runner.models import load_causal_lm

    model = apply_lora(base, LoraConfig(rank=2), 0)
    _perturb_adapters(model, seed=3)
    model.save_pretrained(tmp_path / "model", safe_serialization=True)
    assert (tmp_path / "model" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "model" / "model.safetensors").exists()
    again = apply_lora(load_causal_lm("builtin:tiny-arith"), LoraConfig(rank=2), 1)
    load_adapters(again, tmp_path / "model")
    a, b = dict(merged_weights(model)), dict(merged_weights(again))
    for name in a:
        assert torch.equal(a[name], b[name]), name


GRPO = "recipes/grpo-arith.toml"
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "train.lr=3e-3", "algo.prompts_per_step=4",
        "algo.group_size=4", "rollout.max_new_tokens=4", "data.validation.enabled=false",
        "checkpoint.every_steps=1", "logging.sample_every=0")
FILES = ("model/adapter_model.safetensors", "optimizer.safetensors")


@pytest.mark.slow
def test_lora_grpo_trains_adapters_syncs_merged_weights_and_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    done = run_cli(GRPO, straight, "run.max_steps=3", *LORA)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LoRA rank 4:" in done.stdout
    ckpt = straight / "checkpoints" / "step-000003" / "model"
    assert (ckpt / "adapter_config.json").exists() and not (ckpt / "model.safetensors").exists()
    adapters = final_weights(straight, 3, FILES[0])
    assert adapters and all("lora_" in k for k in adapters)
    assert any(float(v.abs().max()) > 0 for k, v in adapters.items() if "lora_B" in k)  # trained
    # Each step's first forward runs the weights the engine sampled with: after the first
    # update the engine holds the merged adapters, or this gap would be of the update's size.
    gaps = [r["rollout/logprob_gap"] for r in rows(straight)]
    assert len(gaps) == 3 and max(gaps) < 1e-4, gaps

    resumed = tmp_path / "resumed"
    first = run_cli(GRPO, resumed, "run.max_steps=2", *LORA)
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_cli(GRPO, resumed, "run.max_steps=3", *LORA)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "(step 2)" in second.stdout
    assert_same_run(resumed, straight, 3, FILES)
