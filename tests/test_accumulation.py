"""Gradient accumulation changes how a batch is computed, never the update: for every
algorithm, one step with ``train.grad_accum_steps = 3`` (and GRPO / PPO with two minibatches)
ends with the weights of the same step taken in one micro-batch, to 1e-10 relative in float64.

The batches run padded here: with padding-free layouts the micro-batches would share prompts
differently from the whole batch, and the models' RMSNorm computes in float32 whatever their
dtype, so the prompt's gradient, summed over other completions before it, rounds at float32's
level (that layout's own equality is tested in tests/test_policy_logits.py)."""

from __future__ import annotations

import pytest

from tests.resume_helpers import deterministic_rows, final_weights, run_cli

pytestmark = pytest.mark.slow

CASES = {
    "grpo": ("recipes/grpo-arith.toml", ("algo.prompts_per_step=4", "algo.group_size=4",
                                         "algo.minibatches=2", "rollout.max_new_tokens=4")),
    "ppo": ("recipes/ppo-arith.toml", ("algo.prompts_per_step=6", "algo.minibatches=2",
                                       "rollout.max_new_tokens=4")),
    "opd": ("recipes/opd-arith.toml", ("algo.prompts_per_step=4", "rollout.max_new_tokens=4")),
    "dpo": ("recipes/dpo-arith.toml", ("algo.pairs_per_step=6",)),
    "sft": ("recipes/sft-arith.toml", ("algo.examples_per_step=6",)),
    "rm": ("recipes/rm-arith.toml", ("algo.pairs_per_step=6",)),
}
COMMON = ("run.max_steps=1", "data.validation.enabled=false", "model.dtype=float64",
          "logging.sample_every=0", "train.padding_free=false")


@pytest.mark.parametrize("algo", sorted(CASES))
def test_accumulation_gives_the_same_update(algo, tmp_path):
    recipe, extra = CASES[algo]
    weights = {}
    for accum in (1, 3):
        out = tmp_path / f"accum{accum}"
        done = run_cli(recipe, out, *COMMON, *extra, f"train.grad_accum_steps={accum}")
        assert done.returncode == 0, done.stdout + done.stderr
        weights[accum] = final_weights(out, 1)
        row = deterministic_rows(out)[-1]
        assert row["grad_norm"] > 0 and row["lr"] > 0  # the step did move the weights
    one, three = weights[1], weights[3]
    worst = max(float((three[k] - one[k]).norm() / one[k].norm()) for k in one if one[k].norm() > 0)
    assert worst < 1e-10, worst
