"""The GRPO family against independent float64 references: each advantage estimator and each
policy loss written here as plain python loops over rows and tokens (not the vectorised code),
on a small batch with ragged lengths, a masked gap and an empty row, with behaviour logprobs
that differ from the current ones (a stale batch); gradients of GSPO and CISPO by autograd
against their hand formulas; the aggregation, the overlong shaping and the metric reductions."""

from __future__ import annotations

import math

import pytest
import torch

from runner.algorithms.advantages import (
    AdvantageInputs,
    advantages,
    group_advantages,
    rloo_advantages,
    token_returns,
)
from runner.algorithms.grpo import GRPOLossInputs, aggregate, grpo_loss, k3_kl, row_weights
from runner.algorithms.policy_loss import Clip, cispo, gspo, ppo_clip
from runner.algorithms.ppo import PPOLossInputs, ppo_loss
from runner.recipe.schema import GRPOConfig, PPOConfig
from runner.rewards.shaping import Overlong, overlong_penalty

TOL = 1e-12
F64 = torch.float64
# 4 rows, 5 columns: ragged lengths, a gap (an environment's tokens) in row 1, an empty row 3
MASK = [[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def close(actual, expected, atol=TOL):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype),
                               rtol=0, atol=atol)


def _mask():
    return torch.tensor(MASK, dtype=torch.bool)


def _logprobs(seed: int, scale: float = 0.3):
    """Current and (stale) behaviour logprobs of the batch, float64."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, generator=g, dtype=F64) * 2
    return old + scale * torch.randn(4, 5, generator=g, dtype=F64), old


def _valid(b):
    return [t for t, m in enumerate(MASK[b]) if m]


# --- advantages ----------------------------------------------------------------------------


def test_rloo_by_hand():
    # group [1, 0, 0, 1]: 1 - (2 - 1) / 3 = 2/3, 0 - 2/3; group [3, 2, 2, 1] (sum 8):
    # 3 - 5/3 = 4/3, 2 - 6/3 = 0, 1 - 7/3 = -4/3
    adv = rloo_advantages(torch.tensor([1, 0, 0, 1, 3, 2, 2, 1], dtype=F64), 4)
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, 0.0, 0.0, -4 / 3])


@pytest.mark.parametrize("group_size", [2, 3, 5])
def test_rloo_and_grpo_against_loops(group_size):
    r = torch.randn(4 * group_size, generator=torch.Generator().manual_seed(group_size),
                    dtype=F64)
    rl, gr = [], []
    for start in range(0, len(r), group_size):
        g = r[start:start + group_size].tolist()
        mean = sum(g) / len(g)
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1))
        rl += [x - (sum(g) - x) / (len(g) - 1) for x in g]
        gr += [(x - mean) / (std + 1e-6) for x in g]
    close(rloo_advantages(r, group_size), rl)
    close(group_advantages(r, group_size, "group"), gr)


def _returns_loop(scores, kl, beta):
    """REINFORCE++ returns, token by token: -beta kl on each valid token, the score at the last
    valid one, summed from t to the end over the valid tokens."""
    out = []
    for b, row in enumerate(MASK):
        valid = _valid(b)
        reward = {t: -beta * kl[b][t] for t in valid}
        if valid:
            reward[valid[-1]] += scores[b]
        out.append([sum(reward[u] for u in valid if u >= t) if m else 0.0
                    for t, m in enumerate(row)])
    return out


def _whiten_loop(x):
    vals = [x[b][t] for b in range(len(MASK)) for t in _valid(b)]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [[(x[b][t] - mean) / math.sqrt(var + 1e-8) if m else 0.0 for t, m in enumerate(row)]
            for b, row in enumerate(MASK)]


def test_token_returns_by_hand():
    # row 1 (valid 0, 1, 3), score 2, kl (0.1, 0.2, ., 0.4), beta 0.5:
    # rewards -0.05, -0.1, ., 2 - 0.2 -> returns 1.65, 1.7, 0, 1.8
    kl = torch.tensor([[0.0] * 5, [0.1, 0.2, 9.0, 0.4, 9.0], [0.0] * 5, [0.0] * 5], dtype=F64)
    ret = token_returns(torch.tensor([1.0, 2.0, -1.0, 5.0], dtype=F64), _mask(), kl, 0.5)
    close(ret, [[1.0] * 5, [1.65, 1.7, 0.0, 1.8, 0.0], [-1.0, 0, 0, 0, 0], [0.0] * 5])


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_reinforce_pp_against_loops(beta):
    rewards = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 3.0, 1.0, 1.0], dtype=F64)  # 4 x 2 global
    rows = torch.tensor([2, 3, 6, 7])  # this rank's rows (rank 1 of 2): whole groups
    lp, ref = _logprobs(1)
    kl = lp - ref
    adv = advantages("reinforce_pp", AdvantageInputs(
        rewards_N=rewards, rows_B=rows, mask_BT=_mask(), kl_BT=kl, group_size=2, kl_beta=beta))
    scores = [rewards[r].item() for r in rows]
    close(adv, _whiten_loop(_returns_loop(scores, kl.tolist(), beta)))


def test_reinforce_pp_baseline_against_loops():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 3.0, 1.0, 1.0, 1.0], dtype=F64)  # groups of 4
    rows = torch.tensor([4, 5, 6, 7])
    lp, ref = _logprobs(2)
    adv = advantages("reinforce_pp_baseline", AdvantageInputs(
        rewards_N=rewards, rows_B=rows, mask_BT=_mask(), kl_BT=lp - ref, group_size=4,
        kl_beta=0.3))  # the KL stays a loss term: not in these advantages
    mean = (3.0 + 1 + 1 + 1) / 4
    scores = [rewards[r].item() - mean for r in rows]
    close(adv, _whiten_loop(_returns_loop(scores, [[0.0] * 5] * 4, 0.0)))


def test_group_estimators_take_this_ranks_rows_of_the_global_batch():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 2.0, 2.0, 1.0], dtype=F64)
    x = AdvantageInputs(rewards_N=rewards, rows_B=torch.tensor([4, 5, 6, 7]), mask_BT=_mask(),
                        group_size=4, scale="batch")
    close(advantages("rloo", x), rloo_advantages(rewards, 4)[4:])
    close(advantages("grpo", x), group_advantages(rewards, 4, "batch")[4:])


# --- policy losses -------------------------------------------------------------------------


def test_dual_clip_by_hand():
    # r = 3 (A = -1): -min(-3, -1.2) = 3, bounded by -c A = 2 (dual) | r = 0.5 (A = -1): 0.8
    # (clipped low) | r = 1.5 (A = 1): -1.2 (clipped high) | r = 1.1 (A = -2): 2.2 (inside)
    lp = torch.log(torch.tensor([[3.0, 0.5, 1.5, 1.1]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]], dtype=F64)
    terms = ppo_clip(lp, torch.zeros_like(lp), adv, torch.ones(1, 4), Clip(0.2, 0.2, 2.0))
    close(terms.loss_BT.detach(), [[2.0, 0.8, -1.2, 2.2]])
    assert terms.dual_BT.tolist() == [[True, False, False, False]]
    assert terms.low_BT.tolist() == [[False, True, False, False]]
    assert terms.high_BT.tolist() == [[False, False, True, False]]
    terms.loss_BT.sum().backward()
    close(lp.grad, [[0.0, 0.0, 0.0, 2.2]])  # d(-r A)/d lp = -r A = 2.2 inside, 0 where bound


def _gspo_loop(lp, old, adv, low, high):
    """GSPO by hand: per row s = exp(mean of lp - old over its valid tokens); the row's loss is
    -min(s A, clip(s) A); seq_mean over rows with a token. The gradient of a valid token t of
    row b: -s A / (|y_b| x rows) where the unclipped term is the minimum, else 0."""
    rows = [b for b in range(len(MASK)) if _valid(b)]
    loss, grad, ratios = 0.0, [[0.0] * 5 for _ in MASK], []
    for b in rows:
        valid = _valid(b)
        s = math.exp(sum(lp[b][t] - old[b][t] for t in valid) / len(valid))
        a = adv[b]
        clipped = min(max(s, 1 - low), 1 + high)
        loss += -min(s * a, clipped * a) / len(rows)
        ratios.append(s)
        if s * a <= clipped * a:
            for t in valid:
                grad[b][t] = -s * a / (len(valid) * len(rows))
    return loss, grad, ratios


@pytest.mark.parametrize("seed", [1, 2, 6, 8])  # each with clipped and unclipped sequences
def test_gspo_loss_and_gradient_against_the_hand_formula(seed):
    lp, old = _logprobs(seed, scale=0.05)
    adv = torch.tensor([1.0, -0.5, 2.0, 1.0], dtype=F64)
    cfg = GRPOConfig(policy_loss="gspo", loss_agg="seq_mean", gspo_clip_low=0.02,
                     gspo_clip_high=0.03)
    lp = lp.requires_grad_()
    loss, metrics = grpo_loss(GRPOLossInputs(logprobs_BT=lp, old_logprobs_BT=old, adv_B=adv,
                                             mask_BT=_mask(), max_tokens=5), cfg)
    want, grad, ratios = _gspo_loop(lp.tolist(), old.tolist(), adv.tolist(), 0.02, 0.03)
    assert 0 < sum(any(row) for row in grad) < 3  # not vacuous: some rows clipped, some not
    close(loss.detach(), want)
    loss.backward()
    close(lp.grad, grad)
    assert metrics["loss/seq_ratio_mean"].item() == pytest.approx(sum(ratios) / 3, abs=TOL)
    assert metrics["loss/seq_ratio_min"].item() == pytest.approx(min(ratios), abs=TOL)
    assert metrics["loss/seq_ratio_max"].item() == pytest.approx(max(ratios), abs=TOL)


def test_gspo_gives_every_token_of_a_sequence_the_same_weight():
    lp, old = _logprobs(3, scale=0.001)
    lp = lp.requires_grad_()
    terms = gspo(lp, old, torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=F64), _mask(), Clip(0.2, 0.2))
    aggregate(terms.loss_BT, _mask(), "seq_mean", 5).backward()
    for b in range(3):
        g = lp.grad[b, _valid(b)]
        assert torch.allclose(g, g[0].expand_as(g), rtol=0, atol=TOL) and g[0] != 0
    assert lp.grad[3].abs().sum() == 0 and lp.grad[1, 2] == 0


def test_cispo_gradient_is_the_clipped_weight_times_a_grad_logprob():
    lp, old = _logprobs(4, scale=0.5)
    lp = lp.requires_grad_()
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=F64)
    cfg = GRPOConfig(policy_loss="cispo", cispo_clip_high=0.1)
    loss, metrics = grpo_loss(GRPOLossInputs(logprobs_BT=lp, old_logprobs_BT=old, adv_B=adv,
                                             mask_BT=_mask(), max_tokens=5), cfg)
    n = sum(map(sum, MASK))
    value, grad, above = 0.0, [[0.0] * 5 for _ in MASK], 0
    for b in range(4):
        for t in _valid(b):
            r = math.exp(lp[b, t].item() - old[b, t].item())
            w = min(r, 1.1)  # no lower bound
            above += r > 1.1
            value += -w * adv[b].item() * lp[b, t].item() / n
            grad[b][t] = -w * adv[b].item() / n  # sg(w) A grad log pi: no token dropped
    close(loss.detach(), value)
    loss.backward()
    close(lp.grad, grad)
    assert 0 < above < n and metrics["loss/clip_frac_high"].item() == pytest.approx(above / n)
    assert metrics["loss/clip_frac_low"].item() == 0.0


def test_cispo_keeps_the_tokens_ppo_clip_drops():
    lp = torch.log(torch.tensor([[1.5, 0.5]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    cispo(lp, torch.zeros_like(lp), adv, torch.ones(1, 2), Clip(1.0, 0.2)).loss_BT.sum().backward()
    close(lp.grad, [[-1.2, 0.5]])  # -w A: w = 1.2 (clipped), 0.5 (no lower bound)


def test_ppo_loss_takes_the_policy_loss_and_dual_clip_keys():
    lp = torch.log(torch.tensor([[3.0, 1.5, 1.0]], dtype=F64))
    inputs = PPOLossInputs(logprobs_BT=lp, old_logprobs_BT=torch.zeros_like(lp),
                           adv_BT=torch.tensor([[-1.0, 1.0, 2.0]], dtype=F64),
                           mask_BT=torch.ones(1, 3, dtype=torch.bool), values_BT=torch.zeros(1, 3),
                           old_values_BT=torch.zeros(1, 3), returns_BT=torch.zeros(1, 3))
    _, m = ppo_loss(inputs, PPOConfig(clip_ratio_c=2.0))
    assert m["policy_loss"].item() == pytest.approx((2.0 - 1.2 - 2.0) / 3, abs=TOL)
    assert m["loss/dual_clip_frac"].item() == pytest.approx(1 / 3)
    _, m = ppo_loss(inputs, PPOConfig(policy_loss="cispo", cispo_clip_high=0.28))
    want = -(1.28 * -1 * math.log(3) + 1.28 * 1 * math.log(1.5) + 0.0) / 3
    assert m["policy_loss"].item() == pytest.approx(want, abs=TOL)


def test_kl_folded_into_the_reward_is_no_loss_term():
    lp, old = _logprobs(5)
    ref = old - 0.1
    x = GRPOLossInputs(logprobs_BT=lp, old_logprobs_BT=old, ref_logprobs_BT=ref,
                       adv_B=torch.ones(4, 5, dtype=F64), mask_BT=_mask(), max_tokens=5)
    in_reward, m = grpo_loss(x, GRPOConfig(advantage="reinforce_pp", kl_beta=0.5))
    plain, _ = grpo_loss(x, GRPOConfig(advantage="reinforce_pp"))
    as_loss, _ = grpo_loss(x, GRPOConfig(advantage="reinforce_pp_baseline", kl_beta=0.5))
    close(in_reward, plain)
    close(as_loss - plain, 0.5 * aggregate(k3_kl(lp, ref), _mask(), "token_mean", 5))
    assert m["kl"].item() == pytest.approx(aggregate(k3_kl(lp, ref), _mask(), "token_mean", 5))


# --- aggregation, row weights ----------------------------------------------------------------

LOSS_BT = [[1.0, 2.0, 3.0], [4.0, 5.0, 99.0], [7.0, 99.0, 99.0], [99.0, 99.0, 99.0]]


def test_seq_mean_token_sum_by_hand():
    loss = torch.tensor(LOSS_BT, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    out = aggregate(loss, mask, "seq_mean_token_sum", 3)
    close(out.detach(), (6 + 9 + 7) / 3)  # the empty row is left out
    out.backward()
    close(loss.grad, mask.to(F64) / 3)


def test_row_weights_follow_the_aggregation():
    tokens = [3.0, 0.0, 2.0]
    assert row_weights("token_mean", tokens) == [3.0, 0.0, 2.0]
    assert row_weights("seq_mean", tokens) == [1.0, 0.0, 1.0]
    assert row_weights("seq_mean_token_sum", tokens) == [1.0, 0.0, 1.0]
    assert row_weights("dr_grpo", tokens) == [1.0, 1.0, 1.0]


# --- overlong shaping ------------------------------------------------------------------------


@pytest.mark.parametrize("length, want", [(10, 0.0), (12, 0.0), (13, -0.125), (15, -0.375),
                                          (16, -0.5)])
def test_overlong_penalty_by_hand(length, want):
    # max 16, buffer 4, penalty 0.5: free up to 12, then -(L - 12) / 4 x 0.5
    assert overlong_penalty(length, 16, 4, 0.5) == pytest.approx(want, abs=TOL)
    assert Overlong(16, 4, 0.5).penalties([length]) == [pytest.approx(want, abs=TOL)]
    assert overlong_penalty(length, 16, 0, 0.5) == 0.0
