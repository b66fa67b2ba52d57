"""DPO / IPO / label smoothing on hand numbers, and sequence logprobs from logits."""

import math

import pytest
import torch

from runner.algorithms.dpo import DPOLossInputs, dpo_loss, dpo_losses
from runner.algorithms.logprobs import sequence_logprobs, token_logprobs
from runner.recipe.schema import DPOConfig

LN2 = math.log(2)
# h = (pc - rc) - (pr - rr) = [0, 10, 20]
POLICY_CHOSEN = [-0.5, -10.0, -1.0]
POLICY_REJECTED = [-0.1, -30.0, -21.0]
REF_CHOSEN = [-0.5, -10.1, -0.1]
REF_REJECTED = [-0.1, -20.1, -0.1]


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def pairs():
    return t(POLICY_CHOSEN), t(POLICY_REJECTED), t(REF_CHOSEN), t(REF_REJECTED)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, t(expected).to(actual.dtype), rtol=0, atol=atol)


def test_loss_is_ln2_when_policy_equals_reference():
    lp = t([-1.0, -7.5])
    losses, chosen, rejected = dpo_losses(lp, lp - 2, lp, lp - 2, beta=0.3)
    close(losses, [LN2, LN2], atol=1e-12)
    assert chosen.tolist() == [0.0, 0.0] and rejected.tolist() == [0.0, 0.0]


def test_sigmoid_losses_and_rewards_by_hand():
    losses, chosen, rejected = dpo_losses(*pairs(), beta=0.1)
    # -log sigmoid(beta h) = log(1 + exp(-beta h)) for beta h = 0, 1, 2
    close(losses, [0.693147, 0.313262, 0.126928])
    close(chosen, [0.0, 0.01, -0.09], atol=1e-12)
    close(rejected, [0.0, -0.99, -2.09], atol=1e-12)
    assert not chosen.requires_grad


def test_ipo_losses_by_hand():
    losses, _, _ = dpo_losses(*pairs(), beta=0.1, loss_type="ipo")
    close(losses, [25.0, 25.0, 225.0], atol=1e-9)  # (h - 5)^2
    losses, _, _ = dpo_losses(*pairs(), beta=0.5, loss_type="ipo")
    close(losses, [1.0, 81.0, 361.0], atol=1e-9)  # (h - 1)^2


def test_label_smoothing_by_hand():
    losses, _, _ = dpo_losses(*pairs(), beta=0.1, label_smoothing=0.1)
    # 0.9 log(1 + e^-bh) + 0.1 log(1 + e^bh)
    expected = [LN2, 0.9 * 0.3132617 + 0.1 * 1.3132617, 0.9 * 0.1269280 + 0.1 * 2.1269280]
    close(losses, expected)


def test_sigmoid_gradient_at_equal_policy():
    # d/d pc of -log sigmoid(beta h) = -beta sigmoid(-beta h) = -beta / 2 at h = 0
    pc = t([-3.0]).requires_grad_()
    losses, _, _ = dpo_losses(pc, t([-4.0]), t([-3.0]), t([-4.0]), beta=0.1)
    losses.sum().backward()
    close(pc.grad, [-0.05], atol=1e-12)


def test_settings_are_checked_with_the_recipe_not_in_the_loss():
    from runner.errors import RecipeError
    from runner.recipe import recipe_from_mapping

    def problems(**algo):
        try:
            recipe_from_mapping({"algo": {"kind": "dpo", **algo}})
        except RecipeError as exc:
            return exc.lines()
        return []

    assert problems(loss="ipo", label_smoothing=0.1) == [
        "algo.label_smoothing: applies to the sigmoid loss only, but algo.loss is 'ipo' (got 0.1). "
        "Set algo.label_smoothing = 0, or algo.loss = 'sigmoid'."]
    assert problems(label_smoothing=0.5) == ["algo.label_smoothing: must be in [0, 0.5) (got 0.5)."]
    assert problems(label_smoothing=0.49) == []
    assert problems(beta=0.0) == ["algo.beta: must be > 0 (got 0.0)."]
    assert problems(sft_weight=-1.0) == ["algo.sft_weight: must be >= 0 (got -1.0)."]
    with pytest.raises(ValueError, match="loss_type"):
        dpo_losses(*pairs(), beta=0.1, loss_type="hinge")  # type: ignore[arg-type]


def test_dpo_loss_metrics():
    pc, pr, rc, rr = pairs()
    inputs = DPOLossInputs(
        policy_chosen_B=pc, policy_rejected_B=pr, ref_chosen_B=rc, ref_rejected_B=rr
    )
    loss, metrics = dpo_loss(inputs, DPOConfig(beta=0.1))
    close(loss, (0.6931472 + 0.3132617 + 0.1269280) / 3)
    assert metrics["reward_margin"] == pytest.approx(1.0, abs=1e-12)  # mean of 0.1 h = [0, 1, 2]
    assert metrics["accuracy"] == pytest.approx(2 / 3, abs=1e-7)  # tie in pair 0 is not a win
    assert metrics["chosen_reward"] == pytest.approx(-0.08 / 3, abs=1e-12)
    assert metrics["rejected_reward"] == pytest.approx(-3.08 / 3, abs=1e-12)
    assert metrics["chosen_logprob"] == pytest.approx(-11.5 / 3, abs=1e-12)
    assert metrics["rejected_logprob"] == pytest.approx(-51.1 / 3, abs=1e-12)


def test_sft_weight_adds_the_per_token_nll_of_chosen_by_hand():
    # Policy = reference: each pair's preference loss is ln 2. Chosen answers of 2 and 3 tokens
    # with logprobs -2 and -6: per-token NLL 1 and 2, mean 1.5. With sft_weight 0.5:
    # loss = ln 2 + 0.75.
    pc = t([-2.0, -6.0]).requires_grad_()
    pr = t([-3.0, -4.0])
    inputs = DPOLossInputs(policy_chosen_B=pc, policy_rejected_B=pr, ref_chosen_B=t([-2.0, -6.0]),
                           ref_rejected_B=pr, chosen_tokens_B=torch.tensor([2, 3]))
    loss, metrics = dpo_loss(inputs, DPOConfig(beta=0.1, sft_weight=0.5))
    close(loss, LN2 + 0.75, atol=1e-12)
    assert metrics["preference_loss"] == pytest.approx(LN2, abs=1e-12)
    assert metrics["chosen_nll"] == pytest.approx(1.5, abs=1e-12)
    loss.backward()
    # d/d pc_b: preference term -beta/2 / B = -0.025; NLL term 0.5 * (-1 / tokens_b) / B
    close(pc.grad, [-0.025 - 0.125, -0.025 - 0.5 / 6], atol=1e-12)


def test_sft_weight_zero_is_the_plain_loss_and_needs_no_token_counts():
    pc, pr, rc, rr = pairs()
    plain, _ = dpo_loss(DPOLossInputs(policy_chosen_B=pc, policy_rejected_B=pr, ref_chosen_B=rc,
                                      ref_rejected_B=rr), DPOConfig(beta=0.1))
    counted, metrics = dpo_loss(DPOLossInputs(policy_chosen_B=pc, policy_rejected_B=pr,
                                              ref_chosen_B=rc, ref_rejected_B=rr,
                                              chosen_tokens_B=torch.tensor([1, 2, 4])),
                                DPOConfig(beta=0.1))
    assert torch.equal(plain, counted)
    assert metrics["chosen_nll"] == pytest.approx((0.5 + 5.0 + 0.25) / 3, abs=1e-12)
    with pytest.raises(ValueError, match="chosen_tokens_B"):
        dpo_loss(DPOLossInputs(policy_chosen_B=pc, policy_rejected_B=pr, ref_chosen_B=rc,
                               ref_rejected_B=rr), DPOConfig(beta=0.1, sft_weight=1.0))


def test_token_and_sequence_logprobs_by_hand():
    # logits exact in bfloat16; log softmax of [a, b] at b is b - log(e^a + e^b)
    logits = torch.tensor([[[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]]], dtype=torch.bfloat16)
    labels = torch.tensor([[1, 0, -100]])  # -100 reads as token 0, masked by the caller
    lp = token_logprobs(logits, labels)
    assert lp.dtype == torch.float32
    first = 1 - math.log(1 + math.e)
    close(lp, [[first, -LN2, 2 - math.log(1 + math.e**2)]])
    seq = sequence_logprobs(logits, labels, torch.tensor([[1, 1, 0]]))
    close(seq, [first - LN2])
