"""GRPO advantages, k3 KL, clip branches, aggregation modes and one hand-derived gradient."""

import math

import pytest
import torch

from runner.algorithms.grpo import (
    GRPOLossInputs,
    aggregate,
    clipped_token_loss,
    group_advantages,
    grpo_loss,
    k3_kl,
)
from runner.recipe.schema import GRPOConfig

LN2 = math.log(2)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol
    )


# --- advantages ---


def test_group_scale_of_one_zero_zero_one():
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735; 0.5 / 0.57735 = 0.866025
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, "group")
    close(adv, [0.866025, -0.866025, -0.866025, 0.866025], atol=1e-5)


def test_equal_rewards_give_zero_advantage_not_nan():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0]), 4, "group")
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert not adv.isnan().any()


def test_batch_scale_divides_by_the_batch_std():
    # group means 0.5, 2.5 -> centered [0.5, -0.5, 0.5, -0.5]
    # batch [1, 0, 3, 2]: mean 1.5, unbiased var (0.25 + 2.25 + 2.25 + 0.25) / 3 = 5/3
    adv = group_advantages(torch.tensor([1.0, 0.0, 3.0, 2.0]), 2, "batch")
    a = 0.5 / math.sqrt(5 / 3)  # 0.387298
    close(adv, [a, -a, a, -a], atol=1e-5)


def test_none_scale_only_subtracts_the_group_mean():
    adv = group_advantages(torch.tensor([2.0, 0.0, 1.0, 0.0, 0.0, 5.0]), 3, "none")
    close(adv, [1.0, -1.0, 0.0, -5 / 3, -5 / 3, 10 / 3])


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.tensor([1.0, 2.0]), 1, "group")
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2, "group")


# --- k3 ---


def test_k3_on_hand_numbers():
    lp = torch.tensor([[0.0, 0.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[LN2, -LN2, -1.0]], dtype=torch.float64)
    # d = ln2: 2 - ln2 - 1;  d = -ln2: 0.5 + ln2 - 1;  d = 0: 0
    close(k3_kl(lp, ref), [[1 - LN2, LN2 - 0.5, 0.0]], atol=1e-12)


# --- clip branches ---


def _clip(ratios, advs, eps_low, eps_high):
    lp = torch.log(torch.tensor([ratios], dtype=torch.float64)).requires_grad_()
    old = torch.zeros_like(lp)
    loss, clipped = clipped_token_loss(
        lp, old, torch.tensor([advs], dtype=torch.float64), eps_low, eps_high
    )
    loss.sum().backward()
    return loss, clipped, lp.grad


def test_clip_branches_symmetric():
    # A>0 r above 1.2: clipped at 1.2 | A<0 r below 0.8: clipped at 0.8 | A>0 r inside
    # A<0 r above (not clipped, min picks r A) | A>0 r below (not clipped)
    loss, clipped, grad = _clip([1.5, 0.5, 1.1, 1.5, 0.5], [1.0, -1.0, 2.0, -1.0, 1.0], 0.2, 0.2)
    close(loss, [[-1.2, 0.8, -2.2, 1.5, -0.5]], atol=1e-12)
    assert clipped.tolist() == [[True, True, False, False, False]]
    # d(-r A)/d lp = -r A where unclipped, 0 where clipped
    close(grad, [[0.0, 0.0, -2.2, 1.5, -0.5]], atol=1e-12)


def test_clip_asymmetric_bounds():
    # eps_low 0.3, eps_high 0.28: r = 1.25 (A>0) and r = 0.75 (A<0) are inside,
    # r = 1.3 (A>0) clipped at 1.28, r = 0.6 (A<0) clipped at 0.7
    loss, clipped, _ = _clip([1.25, 0.75, 1.3, 0.6], [1.0, -1.0, 1.0, -1.0], 0.3, 0.28)
    close(loss, [[-1.25, 0.75, -1.28, 0.7]], atol=1e-12)
    assert clipped.tolist() == [[False, False, True, True]]
    # the same ratios with symmetric 0.2: all four clipped
    loss, clipped, _ = _clip([1.25, 0.75, 1.3, 0.6], [1.0, -1.0, 1.0, -1.0], 0.2, 0.2)
    close(loss, [[-1.2, 0.8, -1.2, 0.8]], atol=1e-12)
    assert clipped.all()


def test_per_sequence_advantage_broadcasts_over_tokens():
    lp = torch.zeros(2, 3)
    loss, _ = clipped_token_loss(lp, lp, torch.tensor([1.0, -2.0]), 0.2, 0.2)
    close(loss, [[-1.0, -1.0, -1.0], [2.0, 2.0, 2.0]])


# --- aggregation ---

LOSS_BT = [[1.0, 2.0, 3.0], [4.0, 5.0, 99.0], [7.0, 99.0, 99.0]]
MASK_BT = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]


def test_aggregation_modes_on_a_ragged_mask():
    loss = torch.tensor(LOSS_BT)
    mask = torch.tensor(MASK_BT, dtype=torch.bool)
    close(aggregate(loss, mask, "token_mean", 4), 22 / 6)  # (1+2+3+4+5+7) / 6
    close(aggregate(loss, mask, "seq_mean", 4), (2 + 4.5 + 7) / 3)
    close(aggregate(loss, mask, "dr_grpo", 4), 22 / (3 * 4))


@pytest.mark.parametrize(
    "mode, value, grads",
    [
        ("token_mean", 22 / 6, [1 / 6, 1 / 6, 1 / 6]),
        ("seq_mean", 4.5, [1 / 9, 1 / 6, 1 / 3]),  # 1 / (3 rows x row length)
        ("dr_grpo", 22 / 16, [1 / 16, 1 / 16, 1 / 16]),  # B = 4 counts the empty row
    ],
)
def test_all_masked_row_contributes_nothing(mode, value, grads):
    loss = torch.tensor(LOSS_BT + [[float("inf"), float("nan"), -5.0]], requires_grad=True)
    mask = torch.tensor(MASK_BT + [[0, 0, 0]], dtype=torch.bool)
    out = aggregate(loss, mask, mode, 4)
    close(out.detach(), value)
    out.backward()
    expected = torch.tensor([[g] * 3 for g in grads] + [[0.0] * 3]) * mask
    close(loss.grad, expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "dr_grpo"])
def test_empty_mask_gives_zero(mode):
    out = aggregate(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool), mode, 3)
    assert out.item() == 0.0


# --- the full loss ---


def _inputs(lp, ref=None):
    return GRPOLossInputs(
        logprobs_BT=lp,
        old_logprobs_BT=torch.zeros(1, 3, dtype=torch.float64),
        ref_logprobs_BT=ref,
        adv_B=torch.tensor([1.0], dtype=torch.float64),
        mask_BT=torch.tensor([[True, True, False]]),
        max_tokens=3,
    )


def test_grpo_loss_value_gradient_and_metrics_by_hand():
    # token 0: r = 1, A = 1 -> pg -1 (grad -1); ref - lp = ln2 -> k3 = 1 - ln2, grad 1 - 2 = -1
    # token 1: r = e^0.5 > 1.2 -> clipped pg -1.2 (grad 0); ref = lp -> k3 = 0, grad 0
    # token 2: masked. token_mean over 2 tokens, kl_beta = 0.1
    lp = torch.tensor([[0.0, 0.5, 0.3]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[LN2, 0.5, 0.0]], dtype=torch.float64)
    cfg = GRPOConfig(kl_beta=0.1)
    loss, metrics = grpo_loss(_inputs(lp, ref), cfg)
    close(loss.detach(), (-1 + 0.1 * (1 - LN2) - 1.2) / 2, atol=1e-12)
    loss.backward()
    close(lp.grad, [[(-1 - 0.1) / 2, 0.0, 0.0]], atol=1e-12)
    assert metrics["clip_frac"] == 0.5
    assert metrics["kl"] == pytest.approx((1 - LN2) / 2, abs=1e-12)
    assert metrics["ratio_mean"] == pytest.approx((1 + math.exp(0.5)) / 2, abs=1e-12)
    assert metrics["pg_loss"] == pytest.approx(-1.1, abs=1e-12)
    # detached 0-d tensors: read as floats once per optimizer step, never synced per micro-batch
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 and not v.requires_grad
               for v in metrics.values())


def test_grpo_loss_without_kl_ignores_the_reference_in_the_loss():
    lp = torch.tensor([[0.0, 0.5, 0.3]], dtype=torch.float64)
    loss, metrics = grpo_loss(_inputs(lp, torch.zeros(1, 3, dtype=torch.float64)), GRPOConfig())
    close(loss, (-1 - 1.2) / 2, atol=1e-12)
    assert metrics["kl"] == pytest.approx((math.exp(-0.5) + 0.5 - 1) / 2, abs=1e-12)
    _, metrics = grpo_loss(_inputs(lp), GRPOConfig())
    assert "kl" not in metrics


def test_grpo_loss_with_kl_needs_reference():
    with pytest.raises(ValueError, match="kl_beta"):
        grpo_loss(_inputs(torch.zeros(1, 3)), GRPOConfig(kl_beta=0.1))
