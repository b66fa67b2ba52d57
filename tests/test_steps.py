"""One step of each algorithm called directly on a run assembled in this process
(``tests/tiny_run.py``): what ``produce``, ``score`` and ``consume`` return and change, checked
against numbers derived here from the step's own rewards, logprobs and data order."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from runner.algorithms.ppo import ppo_advantages
from runner.data.preference import DatasetPreferenceEnv
from runner.train.loops import dpo, grpo, ppo
from tests.tiny_run import char_code_reward, tiny_run

CHAR_CODE = 'reward.functions=["tests.tiny_run.char_code_reward"]'


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> list[str]:
    return [k for k, v in module.state_dict().items() if not torch.equal(before[k], v)]


def test_grpo_advantages_are_the_group_normalised_rewards(tmp_path):
    with tiny_run("grpo-arith", tmp_path, CHAR_CODE) as run:
        algo = run.svc.recipe.algo
        traj = grpo.produce(run, algo, 1)
        scored = grpo.score(run, algo, run.roles.rewards, traj, 1)
    assert traj.rewards == () and len(traj.completions) == 2 * 4  # produce does not score
    rewards = char_code_reward(scored.traj.texts, scored.traj.items)
    assert scored.rewards_all == rewards  # one rank: its rows are the global batch, in order
    expected = []
    for start in range(0, len(rewards), 4):
        group = rewards[start:start + 4]
        mean, std = statistics.mean(group), statistics.stdev(group)  # unbiased, per group
        expected += [(r - mean) / (std + 1e-6) for r in group]
    assert any(abs(a) > 0.1 for a in expected)  # the groups' rewards differ: not vacuous
    assert scored.adv_B.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert scored.adv_abs_mean == pytest.approx(statistics.mean(abs(a) for a in expected),
                                                rel=1e-5)


def test_ppo_score_whitens_gae_and_consume_trains_policy_and_critic_only(tmp_path):
    with tiny_run("ppo-arith", tmp_path, CHAR_CODE) as run:
        algo, critic, reference = run.svc.recipe.algo, run.roles.critic, run.roles.reference
        assert reference is not None and critic is not None  # kl_coef > 0: a reference
        scored = ppo.score(run, algo, run.roles.rewards, critic, ppo.produce(run, algo, 1), 1)
        s = scored
        # On one rank the global whitening is the batch's own (ppo_advantages' default).
        adv_BT, returns_BT = ppo_advantages(torch.tensor(s.traj.rewards), s.old_BT, s.ref_BT,
                                            s.old_values_BT, s.mask_BT, algo)
        policy, ref_weights = _weights(run.policy.unwrapped()), _weights(reference.model)
        values = _weights(critic.unwrapped())
        metrics = ppo.consume(run, algo, critic, scored)
        after_BT = run.policy.logprobs(s.batch, run.svc.recipe.rollout.temperature)[0]
        ref_after_BT = reference.logprobs(s.batch, run.svc.recipe.rollout.temperature)[0]
        assert _changed(policy, run.policy.unwrapped())
        assert _changed(values, critic.unwrapped())
        assert not _changed(ref_weights, reference.model)
    assert torch.allclose(s.adv_BT, adv_BT, atol=1e-5) and torch.equal(s.returns_BT, returns_BT)
    assert float(s.adv_BT[s.mask_BT].std()) == pytest.approx(1.0, abs=1e-3)
    assert torch.equal(ref_after_BT, s.ref_BT)  # the reference scores as before the update
    assert not torch.equal(after_BT * s.mask_BT, s.old_BT * s.mask_BT)
    kl = float(((s.old_BT - s.ref_BT) * s.mask_BT).sum() / s.mask_BT.sum())
    assert metrics["kl"] == pytest.approx(kl, rel=1e-6, abs=1e-9)


def _dpo_run(run):
    return dpo.DPORun(run, run.svc.recipe.algo, run.roles.reference, run.roles.rewards, {})


def test_dpo_produce_takes_the_steps_pairs_in_data_order(tmp_path):
    with tiny_run("dpo-arith", tmp_path) as run:
        step = _dpo_run(run)
        first, second = dpo.produce(step), dpo.produce(step)
        position = run.state.data.cursor.position
        expected = DatasetPreferenceEnv.from_recipe(run.svc.recipe).next_batch(8)
    assert len(first) == len(second) == 4  # algo.pairs_per_step, all on the one rank
    assert position == 8
    assert [p.id for p in first + second] == [p.id for p in expected]
    assert len({p.id for p in first + second}) == 8  # one epoch of 64 pairs: no repeat


def test_dpo_first_step_loss_is_ln2_while_policy_equals_reference(tmp_path):
    """At step 1 the policy is the reference: every implied reward is 0, so the sigmoid loss
    is -log sigmoid(0) = ln 2 (without the NLL term) and its gradient is not 0."""
    with tiny_run("dpo-arith", tmp_path, "algo.sft_weight=0") as run:
        step = _dpo_run(run)
        scored = dpo.score(step, dpo.produce(step))
        policy = _weights(run.policy.unwrapped())
        metrics = dpo.consume(step, scored)
        assert _changed(policy, run.policy.unwrapped())
    assert scored.ref_chosen_B.shape == scored.ref_rejected_B.shape == (4,)
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["grad_norm"] > 0
