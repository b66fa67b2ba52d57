"""PPO: GAE against a plain reference loop, clip and value-clip hand numbers, KL rewards."""

import pytest
import torch

from runner.algorithms.masked import masked_mean
from runner.algorithms.ppo import (
    PPOLossInputs,
    clipped_policy_loss,
    clipped_policy_token_loss,
    clipped_value_loss,
    gae,
    kl_penalized_rewards,
    ppo_advantages,
    ppo_loss,
)
from runner.recipe.schema import PPOConfig


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol
    )


def reference_gae(rewards, values, lengths, gamma, lam):
    """Per element, in plain python: delta_t = r_t + gamma V_{t+1} - V_t, V_L = 0."""
    adv, ret = [], []
    for r, v, n in zip(rewards, values, lengths, strict=True):
        row_adv = [0.0] * len(r)
        running = 0.0
        for i in range(n - 1, -1, -1):
            next_v = v[i + 1] if i + 1 < n else 0.0
            running = r[i] + gamma * next_v - v[i] + gamma * lam * running
            row_adv[i] = running
        adv.append(row_adv)
        ret.append([row_adv[i] + v[i] if i < n else 0.0 for i in range(len(r))])
    return adv, ret


@pytest.mark.parametrize("seed, gamma, lam", [(0, 1.0, 0.95), (1, 0.9, 1.0), (2, 0.99, 0.0)])
def test_gae_matches_reference_loop_on_ragged_masks(seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 1, 0, 5]
    rewards = torch.randn(5, 7, generator=g, dtype=torch.float64)
    values = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.tensor([[i < n for i in range(7)] for n in lengths])
    values_padded = torch.where(mask, values, torch.full_like(values, 1e6))  # must be ignored
    adv, ret = gae(rewards, values_padded, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_two_steps_by_hand():
    # delta_1 = 1 + 0 - 0.2 = 0.8;  delta_0 = 0 + 0.2 - 0.5 = -0.3;  A_0 = -0.3 + 0.5 * 0.8
    adv, ret = gae(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.2]]), torch.ones(1, 2), 1.0, 0.5
    )
    close(adv, [[0.1, 0.8]])
    close(ret, [[0.6, 1.0]])


def test_gae_steps_over_an_environments_tokens_by_hand():
    """A two-turn episode: assistant tokens at 0, 1 and 4, the environment's at 2 and 3 (their
    rewards and values must be ignored). With gamma 0.9, lam 0.5, V = (0.5, 0.2, ., ., 0.4),
    r = (0, 0.1, ., ., 1):
    delta_4 = 1 - 0.4 = 0.6;  A_4 = 0.6
    delta_1 = 0.1 + 0.9 * 0.4 - 0.2 = 0.26;  A_1 = 0.26 + 0.45 * 0.6 = 0.53
    delta_0 = 0 + 0.9 * 0.2 - 0.5 = -0.32;  A_0 = -0.32 + 0.45 * 0.53 = -0.0815
    """
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    rewards = torch.tensor([[0.0, 0.1, 7.0, 7.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.4]], dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, 0.9, 0.5)
    close(adv, [[-0.0815, 0.53, 0.0, 0.0, 0.6]])
    close(ret, [[0.4185, 0.73, 0.0, 0.0, 1.0]])


def test_advantages_after_a_prompt_equal_the_left_aligned_ones():
    """A completion laid after its prompt (mask not starting at column 0) gets exactly the
    advantages and returns of the same completion laid from column 0."""
    torch.manual_seed(0)
    score, lp, ref, val = torch.randn(2), torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    cfg = PPOConfig(kl_coef=0.1, gamma=0.9, lam=0.8, whiten_advantages=False)
    adv, ret = ppo_advantages(score, lp, ref, val, mask, cfg)

    def shift(x):
        return torch.cat([torch.zeros(2, 2), x], dim=1)

    adv2, ret2 = ppo_advantages(score, shift(lp), shift(ref), shift(val), shift(mask), cfg)
    assert torch.equal(adv2[:, 2:], adv) and torch.equal(ret2[:, 2:], ret)
    assert not adv2[:, :2].any()


def test_kl_penalized_rewards_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # -0.1 (lp - ref) = [[-0.05, 0, 0.2], [-0.05, 0.1, 0]], scores at t = 2 and t = 1
    rewards = kl_penalized_rewards(torch.tensor([1.0, -2.0]), lp, ref, mask, 0.1)
    close(rewards, [[-0.05, 0.0, 1.2], [-0.05, -1.9, 0.0]])


def test_kl_penalized_rewards_rejects_empty_rows():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        kl_penalized_rewards(
            torch.zeros(2),
            torch.zeros(2, 2),
            torch.zeros(2, 2),
            torch.tensor([[1, 0], [0, 0]]),
            0.1,
        )


def _policy_case():
    # ratios [0.5, 1, 1.5] with advantages [1, -1, 2]
    lp = torch.log(torch.tensor([[0.5, 1.0, 1.5]], dtype=torch.float64))
    return lp, torch.zeros_like(lp), torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)


def test_clipped_policy_loss_by_hand():
    lp, old, adv = _policy_case()
    token_loss, clipped = clipped_policy_token_loss(lp, old, adv, 0.2)
    # -min(0.5, 0.8) | -min(-1, -1) | -min(3, 2.4)
    close(token_loss, [[-0.5, 1.0, -2.4]], atol=1e-12)
    assert clipped.tolist() == [[False, False, True]]
    loss, metrics = clipped_policy_loss(lp, old, adv, torch.ones(1, 3, dtype=torch.bool), 0.2)
    close(loss, -1.9 / 3, atol=1e-12)  # -0.633333
    assert metrics["clip_frac"] == pytest.approx(1 / 3, abs=1e-7)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-12)


VALUES = [[1.0, 0.0, 2.0, 50.0]]
OLD_VALUES = [[0.5, 0.5, 2.0, 0.0]]
RETURNS = [[2.0, 1.0, 0.0, 0.0]]
VALUE_MASK = [[1, 1, 1, 0]]


def test_clipped_value_loss_by_hand():
    # v=1 -> clip 0.7: max(1, 1.69) | v=0 -> clip 0.3: max(1, 0.49) | v=2 inside: 4 ; halves
    loss = clipped_value_loss(
        torch.tensor(VALUES),
        torch.tensor(OLD_VALUES),
        torch.tensor(RETURNS),
        torch.tensor(VALUE_MASK),
        0.2,
    )
    close(loss, (0.845 + 0.5 + 2.0) / 3)  # 1.115


def test_ppo_loss_combines_policy_and_value():
    lp, old, adv = _policy_case()
    pad = torch.zeros(1, 1, dtype=torch.float64)
    inputs = PPOLossInputs(
        logprobs_BT=torch.cat([lp, pad], 1),
        old_logprobs_BT=torch.cat([old, pad], 1),
        adv_BT=torch.cat([adv, pad], 1),
        mask_BT=torch.tensor(VALUE_MASK, dtype=torch.bool),
        values_BT=torch.tensor(VALUES, dtype=torch.float64),
        old_values_BT=torch.tensor(OLD_VALUES, dtype=torch.float64),
        returns_BT=torch.tensor(RETURNS, dtype=torch.float64),
    )
    loss, metrics = ppo_loss(inputs, PPOConfig(vf_coef=0.5))
    close(loss, -1.9 / 3 + 0.5 * 1.115, atol=1e-12)  # -0.075833
    assert metrics["value_loss"] == pytest.approx(1.115, abs=1e-12)
    assert metrics["policy_loss"] == pytest.approx(-1.9 / 3, abs=1e-12)


def test_ppo_advantages_chains_rewards_gae_and_whitening():
    g = torch.Generator().manual_seed(3)
    lp, ref, values = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    score = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    cfg = PPOConfig(kl_coef=0.05, gamma=0.9, lam=0.8, whiten_advantages=False)
    adv, ret = ppo_advantages(score, lp, ref, values, mask, cfg)
    want_adv, want_ret = gae(
        kl_penalized_rewards(score, lp, ref, mask, 0.05), values, mask, 0.9, 0.8
    )
    close(adv, want_adv, atol=0)
    close(ret, want_ret, atol=0)
    white, white_ret = ppo_advantages(
        score, lp, ref, values, mask, PPOConfig(kl_coef=0.05, gamma=0.9, lam=0.8)
    )
    close(white_ret, want_ret, atol=0)
    close(masked_mean(white, mask), 0.0, atol=1e-12)
    close(masked_mean(white**2, mask) * 7 / 6, 1.0, atol=1e-6)  # unbiased variance over 7 tokens
