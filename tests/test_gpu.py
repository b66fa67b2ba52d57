"""The CUDA path: bf16 autocast training, the hf engine on the GPU, chunked and padding-free
logprobs there. Skipped without a CUDA device (``benchmarks/gpu_check.sh`` runs them on a GPU
host)."""

from __future__ import annotations

import pytest
import torch

from runner.packers.base import RLPolicyInput, collate
from tests.resume_helpers import rows, run_cli

pytestmark = pytest.mark.gpu


def _inputs() -> list[RLPolicyInput]:
    shapes = [(14, 5), (6, 2), (9, 4), (5, 1), (12, 3), (7, 7)]
    return [RLPolicyInput(tuple(3 + (7 * i + j) % 50 for j in range(n)), (0,) * (n - k) + (1,) * k,
                          n - k) for i, (n, k) in enumerate(shapes)]


def test_auto_precision_is_bf16_on_a_bf16_gpu():
    from runner.precision import resolve
    from runner.recipe import recipe_from_mapping

    p = resolve(recipe_from_mapping({"train": {"precision": "auto"}}), "cuda")
    assert p.train == ("bf16" if torch.cuda.is_bf16_supported() else "no")
    assert p.engine_dtype == ("bfloat16" if p.train == "bf16" else "float32")


def test_padding_free_and_chunked_logprobs_on_cuda():
    from runner.models import load_causal_lm
    from runner.train.roles.policy import batch_logprobs

    model = load_causal_lm("builtin:tiny-arith").cuda()
    batch = collate(_inputs(), 0).to("cuda")
    padded, mask = batch_logprobs(model, batch, 0.8)
    free, _ = batch_logprobs(model, batch, 0.8, pad_free=True)
    torch.testing.assert_close(free[mask], padded[mask], rtol=0, atol=1e-5)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp_bf16, _ = batch_logprobs(model, batch, 0.8)
    assert lp_bf16.dtype == torch.float32
    assert float((lp_bf16 - padded)[mask].abs().max()) < 0.1  # bf16 matmuls, fp32 log-softmax


@pytest.mark.parametrize("recipe", ["recipes/grpo-arith.toml", "recipes/ppo-arith.toml"])
def test_bf16_training_on_cuda_with_the_engine_in_bf16(recipe, tmp_path):
    done = run_cli(recipe, tmp_path, "run.device=cuda", "train.precision=auto", "run.max_steps=3",
                   "algo.prompts_per_step=4", "rollout.max_new_tokens=4",
                   "data.validation.enabled=false", "algo.engine_is_correction=true")
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = rows(tmp_path)
    assert len(metrics) == 3
    for row in metrics:
        assert all(v == v for v in row.values() if isinstance(v, float))  # no NaN
        # bf16 engine vs bf16-autocast policy: close, not equal
        assert row["rollout/logprob_gap"] < 0.5, row
