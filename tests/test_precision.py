"""bf16 done right: the precision a run chooses and why, the engine's dtype, the truncated
importance weights that correct for an engine with other numerics, and log-probabilities of
reduced-precision or large logits computed in chunks with the same values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from runner.algorithms.grpo import GRPOLossInputs, engine_is_weights, grpo_loss
from runner.algorithms.logprobs import chunked_token_logprobs, token_logprobs
from runner.algorithms.ppo import clipped_policy_loss
from runner.errors import RecipeError
from runner.recipe import recipe_from_mapping
from runner.recipe.schema import GRPOConfig


def _recipe(**tables):
    return recipe_from_mapping(tables)


@pytest.fixture
def cpu_flags(monkeypatch):
    import runner.precision as precision

    def set_flags(flags):
        monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: tuple(flags))

    return set_flags


def test_auto_trains_in_bf16_only_where_bf16_is_native(cpu_flags):
    from runner.precision import resolve

    cpu_flags(["avx512_bf16"])
    p = resolve(_recipe(train={"precision": "auto"}), "cpu")
    assert (p.train, p.engine_dtype) == ("bf16", "bfloat16")
    assert "avx512_bf16" in p.why and "rollout.dtype auto" in p.why
    cpu_flags([])
    p = resolve(_recipe(train={"precision": "auto"}), "cpu")
    assert (p.train, p.engine_dtype) == ("no", "float32")
    assert "neither AVX-512 BF16 nor AMX" in p.why


def test_engine_dtype_follows_the_policy_unless_set(cpu_flags):
    from runner.precision import resolve

    cpu_flags(["amx_bf16"])
    assert resolve(_recipe(), "cpu").engine_dtype == "float32"  # precision "no" by default
    assert resolve(_recipe(model={"dtype": "float64"}), "cpu").engine_dtype == "float64"
    p = resolve(_recipe(train={"precision": "bf16"}, rollout={"dtype": "float32"}), "cpu")
    assert (p.train, p.engine_dtype) == ("bf16", "float32")
    cpu_flags([])  # bf16 asked for explicitly on a CPU without it: the engine stays float32
    p = resolve(_recipe(train={"precision": "bf16"}), "cpu")
    assert (p.train, p.engine_dtype) == ("bf16", "float32")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    from runner.precision import cpu_bf16_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 avx512_bf16\n")
    assert cpu_bf16_flags(str(info)) == ("avx512_bf16", "amx_bf16")
    other = tmp_path / "cpuinfo-avx2"
    other.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert cpu_bf16_flags(str(other)) == ()
    assert cpu_bf16_flags(str(tmp_path / "missing")) == ()


def test_dry_run_says_which_precision_and_why(run_cli):
    rc, out, _ = run_cli("--plain", "--dry-run", "recipes/grpo-arith.toml", "train.precision=auto")
    assert rc == 0
    assert "precision chosen because" in out and "train.precision auto" in out
    assert "rollout dtype" in out


def test_engine_importance_weights_on_hand_numbers():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    engine = torch.log(torch.tensor([[0.25, 0.4, 0.3]]))
    w = engine_is_weights(old, engine, cap=2.5)
    # 0.5 / 0.25 = 2, 0.2 / 0.4 = 0.5, 0.9 / 0.3 = 3 -> capped at 2.5
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.5]]), rtol=0, atol=1e-6)
    assert not w.requires_grad


def test_grpo_loss_weights_only_the_policy_gradient_term():
    cfg = GRPOConfig(kl_beta=0.5)
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    is_w = torch.tensor([[2.0, 0.5]])
    loss, metrics = grpo_loss(GRPOLossInputs(logprobs_BT=lp, old_logprobs_BT=old,
                                             adv_B=torch.tensor([1.0]),
                                             ref_logprobs_BT=ref, mask_BT=mask, max_tokens=2,
                                             is_weights_BT=is_w), cfg)
    # ratio 1 everywhere: pg = -A = -1 per token, weighted 2 and 0.5; k3(d) = e^d - d - 1.
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    expected = ((-1.0 * 2.0 + 0.5 * k3[0]) + (-1.0 * 0.5 + 0.5 * k3[1])) / 2
    assert abs(float(loss.detach()) - expected) < 1e-6
    assert abs(metrics["engine_is_weight"] - 1.25) < 1e-6
    (grad,) = torch.autograd.grad(loss, lp)
    # d/dlp of -w A r at r = 1 is -w A; of beta k3 is beta (1 - e^d); divided by 2 tokens
    expected_grad = [(-2.0 + 0.5 * (1 - math.exp(-0.5))) / 2,
                     (-0.5 + 0.5 * (1 - math.exp(1.0))) / 2]
    torch.testing.assert_close(grad, torch.tensor([expected_grad]), rtol=0, atol=1e-6)


def test_ppo_policy_loss_takes_the_weights():
    lp = torch.tensor([[-1.0, -1.0]])
    adv = torch.tensor([[1.0, -2.0]])
    mask = torch.ones(1, 2)
    plain, _ = clipped_policy_loss(lp, lp, adv, mask, 0.2)
    weighted, _ = clipped_policy_loss(lp, lp, adv, mask, 0.2, torch.tensor([[3.0, 1.0]]))
    assert abs(float(plain) - 0.5) < 1e-6  # (-1 + 2) / 2
    assert abs(float(weighted) - (-3.0 + 2.0) / 2) < 1e-6


def test_importance_cap_and_policy_source_are_checked():
    with pytest.raises(RecipeError) as info:
        recipe_from_mapping({"algo": {"engine_is_correction": True, "old_logprobs": "engine",
                                      "engine_is_cap": 0.5}})
    text = "\n".join(info.value.lines())
    assert "algo.engine_is_cap" in text and ">= 1" in text
    assert "algo.old_logprobs = 'engine'" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_logprobs_equal_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 1000, generator=g, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, 1000, (3, 7), generator=g)
    weights = torch.randn(3, 7, generator=g, dtype=dtype)
    direct = torch.log_softmax(logits / 0.7, -1).gather(-1, labels[..., None]).squeeze(-1)
    chunked = chunked_token_logprobs(logits, labels, chunk_elements=2500, temperature=0.7)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(chunked, direct, rtol=tol, atol=tol)
    (g_direct,) = torch.autograd.grad((direct * weights).sum(), logits)
    (g_chunked,) = torch.autograd.grad((chunked * weights).sum(), logits)
    torch.testing.assert_close(g_chunked, g_direct, rtol=tol, atol=tol)


def test_bf16_logits_are_scored_in_float32_without_a_full_copy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 300, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, 300, (2, 5), generator=g)
    lp = token_logprobs(logits, labels)
    assert lp.dtype == torch.float32
    exact = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(lp, exact, rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    assert grad.dtype == torch.bfloat16
    onehot = torch.nn.functional.one_hot(labels, 300).float()
    expected = onehot - torch.softmax(logits.detach().float(), -1)
    torch.testing.assert_close(grad.float(), expected, rtol=0, atol=8e-3)  # bf16 rounding


@pytest.mark.vllm
@pytest.mark.slow
def test_bf16_vllm_engine_takes_weight_updates_and_the_correction_applies(tmp_path):
    """vLLM in bf16 on this CPU: its weights stay updatable parameters (no packed kernel drops
    them), the policy under bf16 autocast sees the engine's tokens with a small logprob gap,
    and the importance weights stay near 1."""
    pytest.importorskip("vllm")
    from runner.precision import cpu_bf16_flags
    from tests.resume_helpers import rows, run_cli

    if not cpu_bf16_flags():
        pytest.skip("this CPU has no native bf16: auto precision is fp32 here")
    done = run_cli("recipes/grpo-arith.toml", tmp_path, "rollout.engine=vllm",
                   "train.precision=auto",
                   "algo.engine_is_correction=true", "run.max_steps=3", "algo.prompts_per_step=4",
                   "algo.group_size=4", "rollout.max_new_tokens=4", "data.validation.enabled=false")
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = rows(tmp_path)
    assert len(metrics) == 3
    for row in metrics:
        assert 0 < row["rollout/logprob_gap"] < 0.2, row
        assert abs(row["engine_is_weight"] - 1.0) < 0.05, row
