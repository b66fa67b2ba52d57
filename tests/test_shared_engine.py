"""The hf engine on the policy's own module (``rollout.share_policy``): where a copy would hold
the same numbers, the engine generates with the trained model itself, and a run is the one with a
copy, bitwise."""

from __future__ import annotations

import pytest
import torch

from runner.precision import resolve, shares_policy
from runner.recipe import load_recipe
from runner.rollout.base import SamplingConfig
from tests.conftest import REPO
from tests.resume_helpers import deterministic_rows, final_weights
from tests.resume_helpers import run_cli as run_recipe

PROMPTS = [[1, 40, 22, 17, 23, 35], [1, 41, 25, 18, 26, 35]]
SAMPLING = SamplingConfig(n=3, max_new_tokens=6, temperature=1.0)


def _generate(engine):
    return [(c.token_ids, c.logprobs) for out in engine.generate(PROMPTS, SAMPLING, seeds=[5, 6])
            for c in out.completions]


def test_a_shared_engine_generates_as_a_copy_and_leaves_the_policy_training():
    from runner.models import load_causal_lm, load_tokenizer
    from runner.rollout.hf import HFEngine

    policy = load_causal_lm("builtin:tiny-arith").train()
    shared = HFEngine(policy, load_tokenizer("builtin:tiny-arith"), shares_weights=True)
    copy = HFEngine.from_path("builtin:tiny-arith")
    first = _generate(shared)
    assert first == _generate(copy)
    assert policy.training  # back in training mode after generating
    with torch.no_grad():  # an update: the shared engine reads it at once, the copy once given
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    moved = _generate(shared)
    assert moved != first and _generate(copy) == first
    shared.update_weights(iter([("model.nope", torch.zeros(1))]))  # nothing to copy, no check
    copy.update_weights((n, p.detach()) for n, p in policy.named_parameters())
    assert _generate(copy) == moved and policy.training


@pytest.mark.parametrize(("overrides", "shares"), [
    (("train.precision=no",), True),
    (("train.precision=no", "model.dtype=float64"), True),  # float64 policy, float64 engine
    (("train.precision=no", "rollout.share_policy=false"), False),
    (("train.precision=bf16",), False),  # autocast: the engine's bf16 weights differ
    (("train.precision=no", "rollout.dtype=bfloat16"), False),
    (("train.precision=no", "model.lora.rank=4"), False),  # the engine reads merged weights
    (("train.precision=no", "algo.max_off_policy_steps=1"), False),  # sampled while it trains
    (("train.precision=no", "rollout.engine=vllm"), False),
    (("train.precision=no", "launch.backend=ray", "launch.placement=separate"), False),
    (("train.precision=no", "train.sharding=fsdp", "launch.backend=torchrun",
      "launch.num_processes=2"), False),
])
def test_the_engine_shares_the_policy_only_where_a_copy_holds_the_same_numbers(overrides, shares):
    recipe = load_recipe(REPO / "recipes" / "grpo-arith.toml", list(overrides))
    assert shares_policy(recipe, resolve(recipe, "cpu")) is shares


@pytest.mark.slow
def test_a_run_on_the_shared_policy_equals_one_with_a_copy(tmp_path, run_cli):
    """fp32 GRPO with held-out evaluations: every metric, the checkpoint's weights and its
    optimizer state bitwise; the dry run names the choice."""
    common = ("train.precision=no", "run.max_steps=3", "logging.sample_every=0",
              "data.validation.size=16", "train.eval_every=2", "checkpoint.every_steps=3")
    runs = {}
    for share in ("true", "false"):
        done = run_recipe("recipes/grpo-arith.toml", tmp_path / share, *common,
                          f"rollout.share_policy={share}")
        assert done.returncode == 0, done.stdout + done.stderr
        runs[share] = tmp_path / share
    got, want = deterministic_rows(runs["true"]), deterministic_rows(runs["false"])
    assert len(got) == 4 and got == want  # step 0's evaluation and three steps
    assert any("eval/" in k for k in got[-1])
    for name in ("model/model.safetensors", "optimizer.safetensors"):
        one, two = final_weights(runs["true"], 3, name), final_weights(runs["false"], 3, name)
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    rc, out, err = run_cli("--plain", "--dry-run", "recipes/grpo-arith.toml", *common[:1])
    assert rc == 0, err
    shown = " ".join(out.replace("│", " ").split())
    assert "the policy's own model (rollout.share_policy)" in shown
