"""The GRPO family's keys around the losses: the combinations a recipe refuses (one line each,
reported together), the overlong shaping and the truncation mask on a trajectory, the extreme
metrics' reduction, and two short runs from ``posttrain-run`` that use every key."""

from __future__ import annotations

import math

import pytest
import torch

from runner.errors import RecipeError
from runner.packers.base import RLPolicyInput
from runner.recipe import recipe_from_mapping
from runner.rewards import RewardSet
from runner.rewards.shaping import Overlong
from runner.rollout.base import Completion
from runner.train.loops.batches import _accumulate, reduce_history
from runner.train.loops.rollouts import overlong_of, reward_trajectory
from runner.train.loops.trajectory import Trajectory, without_loss
from runner.types import ObsBundle
from tests.resume_helpers import rows, run_cli


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe_from_mapping({}, source="r.toml", overrides=overrides)
    return info.value.lines()


CL = "command line: "
DUAL = (CL + "algo.clip_ratio_c: must be 0 (off) or > 1 (got {}). The dual clip bounds a "
        "negative advantage's loss by -c A, which for c <= 1 would cut the loss of an unchanged "
        "policy; 3 is common.")


@pytest.mark.parametrize("overrides, lines", [
    (("algo.advantage=rloo", "algo.group_size=1"),
     [CL + "algo.group_size: must be >= 2 with advantage = 'rloo' (the leave-one-out baseline "
      "is the mean of the group's other members) (got 1)."]),
    (("algo.clip_ratio_c=1.0",), [DUAL.format("1.0")]),
    (("algo.policy_loss=cispo", "algo.clip_ratio_c=3"),
     [CL + "algo.clip_ratio_c: is a key of policy_loss = 'ppo_clip', but policy_loss is 'cispo' "
      "(got 3.0). Remove it, or set algo.policy_loss = 'ppo_clip'."]),
    (("algo.policy_loss=gspo", "algo.loss_agg=seq_mean", "algo.clip_eps_high=0.28"),
     [CL + "algo.clip_eps_high: is a key of policy_loss = 'ppo_clip', but policy_loss is 'gspo' "
      "(got 0.28). Remove it, or set algo.policy_loss = 'ppo_clip'."]),
    (("algo.kind=ppo", "algo.cispo_clip_high=1"),
     [CL + "algo.cispo_clip_high: is a key of policy_loss = 'cispo', but policy_loss is "
      "'ppo_clip' (got 1.0). Remove it, or set algo.policy_loss = 'cispo'."]),
    (("algo.policy_loss=gspo",),
     ["r.toml: algo.loss_agg: policy_loss = 'gspo' averages each sequence's tokens, then the "
      "sequences (the GSPO objective); it needs loss_agg = 'seq_mean' (got 'token_mean'). Set "
      "algo.loss_agg = 'seq_mean'."]),
    (("algo.advantage=reinforce_pp", "algo.scale_rewards=batch"),
     [CL + "algo.scale_rewards: only applies to advantage = 'grpo' (the 'reinforce_pp' "
      "estimator has its own scale) (got 'batch'). Remove algo.scale_rewards, or set "
      "algo.advantage = 'grpo'."]),
    (("algo.advantage=reinforce_pp", "algo.group_size=1", "algo.shared_prefix_filter=true"),
     [CL + "algo.shared_prefix_filter: needs a group of at least 2 completions to share a prefix "
      "(got True). Raise algo.group_size, or turn the filter off."]),
    (("algo.policy_loss=gspo", "algo.loss_agg=seq_mean", "algo.gspo_clip_low=1.5"),
     [CL + "algo.gspo_clip_low: must be in [0, 1) (got 1.5)."]),
    (("algo.policy_loss=cispo", "algo.cispo_clip_high=-1"),
     [CL + "algo.cispo_clip_high: must be >= 0 (got -1.0)."]),
    (("rollout.max_new_tokens=4", "reward.overlong_buffer_len=5", "reward.overlong_penalty=-1"),
     [CL + "reward.overlong_buffer_len: must be in [0, rollout.max_new_tokens (4)] (got 5).",
      CL + "reward.overlong_penalty: must be >= 0 (got -1.0)."]),
    (("algo.kind=dpo", "reward.overlong_buffer_len=2"),
     [CL + "reward.overlong_buffer_len: only GRPO and PPO train on shaped rewards, but "
      "algo.kind is 'dpo' (got 2). Remove the key."]),
    (("algo.kind=ppo", "algo.policy_loss=gspo"),
     [CL + "algo.policy_loss: not a valid choice (got 'gspo'). Choose one of 'ppo_clip', "
      "'cispo'."]),
    (("algo.kind=ppo", "algo.clip_ratio_c=0.5"), [DUAL.format("0.5")]),
])
def test_combinations_that_make_no_sense_are_refused(overrides, lines):
    assert _problems(*overrides) == lines


def test_the_problems_are_reported_together():
    lines = _problems("algo.advantage=rloo", "algo.group_size=1", "algo.scale_rewards=none",
                      "algo.policy_loss=gspo")
    assert [line.split(": ")[1] for line in lines] == [
        "algo.group_size", "algo.scale_rewards", "algo.loss_agg"]


def test_the_keys_that_fit_are_accepted():
    r = recipe_from_mapping({}, overrides=["algo.advantage=reinforce_pp", "algo.group_size=1",
                                           "algo.clip_ratio_c=3", "algo.mask_truncated=true",
                                           "algo.loss_agg=seq_mean_token_sum",
                                           "reward.overlong_buffer_len=4"])
    assert (r.algo.advantage, r.algo.group_size, r.algo.clip_ratio_c) == ("reinforce_pp", 1, 3.0)
    assert overlong_of(r) == Overlong(r.rollout.max_new_tokens, 4, 1.0)
    assert overlong_of(recipe_from_mapping({})) is None


def _trajectory() -> Trajectory:
    item = ObsBundle(prompt="1+1")
    completions = (Completion((5, 6, 2), "a", (-0.1, -0.2, -0.3), "stop"),
                   Completion((5, 6, 7, 8), "b", (-0.1,) * 4, "length"),
                   Completion((5,), "c", (-0.5,), "stop"))
    return Trajectory((item,) * 3, ((1, 2),) * 3, completions)


def test_the_overlong_shaping_is_added_to_the_rewards_and_logged():
    rewards = RewardSet(("one",), (lambda completions, items: [1.0] * len(completions),), (1.0,))
    traj = reward_trajectory(_trajectory(), rewards, 1, Overlong(4, 2, 0.5))
    # lengths 3, 4, 1 with max 4, buffer 2, penalty 0.5: -(3 - 2) / 2 x 0.5, -0.5, 0
    assert traj.rewards == (0.75, 0.5, 1.0)
    assert traj.reward_parts["reward/overlong_penalty"] == pytest.approx(-0.75 / 3)
    assert reward_trajectory(_trajectory(), rewards, 1).rewards == (1.0, 1.0, 1.0)


def test_truncated_completions_carry_no_loss():
    traj = _trajectory()
    assert traj.truncated == (False, True, False)
    inputs = [RLPolicyInput((1, 2, *c.token_ids), (0, 0) + (1,) * len(c.token_ids), 2)
              for c in traj.completions]
    kept = without_loss(inputs, traj.truncated)
    assert [x.loss_mask for x in kept] == [(0, 0, 1, 1, 1), (0,) * 6, (0, 0, 1)]
    assert kept[1].input_ids == inputs[1].input_ids


class _TwoRanks:
    """A world of two ranks seen from one: the other rank's metric history is given."""

    world = 2

    def __init__(self, other: list[dict[str, float]]) -> None:
        self.other = other

    def sum(self, values):
        keys = sorted({k for h in self.other for k in h if not k.endswith(("_min", "_max"))})
        theirs = [h.get(k, 0.0) for h in self.other for k in keys]
        return [a + b for a, b in zip(values, theirs, strict=True)]

    def gather(self, value):
        keys = sorted({k for h in self.other for k in h if k.endswith(("_min", "_max"))})
        return [value, [[h[k] for h in self.other if k in h] for k in keys]]


def test_extremes_are_the_smallest_and_largest_of_every_micro_batch_rank_and_step():
    acc = None
    for value, has_rows in ((0.9, True), (0.1, False), (0.8, True)):  # no row: not counted
        acc = _accumulate("loss/seq_ratio_min", acc, torch.tensor(value), 0.5, has_rows)
    assert float(acc) == pytest.approx(0.8)
    assert _accumulate("loss", 1.0, torch.tensor(2.0), 0.25, True) == 1.5  # share-weighted
    mine = [{"loss": 1.0, "r_min": 0.9, "r_max": 1.1}, {"loss": 2.0, "r_min": 0.7, "r_max": 1.0}]
    other = [{"loss": 0.5, "r_min": math.inf, "r_max": -math.inf},  # held no row
             {"loss": 0.5, "r_min": 0.8, "r_max": 1.3}]
    out = reduce_history(_TwoRanks(other), mine)
    assert out == {"loss": pytest.approx(2.0), "r_min": 0.7, "r_max": 1.3}


def _metrics(out) -> list[dict]:
    return [r for r in rows(out) if "loss" in r]


SHORT = ("run.max_steps=2", "data.validation.enabled=false", "logging.sample_every=0",
         "algo.prompts_per_step=4", "algo.group_size=4", "rollout.max_new_tokens=4")


@pytest.mark.slow
def test_gspo_with_the_baseline_and_overlong_shaping_runs_from_the_cli(tmp_path):
    done = run_cli("recipes/grpo-gspo-arith.toml", tmp_path, *SHORT,
                   "algo.advantage=reinforce_pp_baseline", "algo.mask_truncated=true",
                   "reward.overlong_buffer_len=2", "reward.overlong_penalty=0.5")
    assert done.returncode == 0, done.stdout + done.stderr
    steps = _metrics(tmp_path)
    assert len(steps) == 2
    for r in steps:
        assert r["loss/seq_ratio_min"] <= r["loss/seq_ratio_mean"] <= r["loss/seq_ratio_max"]
        assert -0.5 <= r["reward/overlong_penalty"] <= 0 and 0 <= r["rollout/truncated_frac"] <= 1
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "adv_abs_mean"))


@pytest.mark.slow
def test_reinforce_pp_with_kl_dual_clip_and_a_stale_batch_runs_from_the_cli(tmp_path):
    done = run_cli("recipes/rloo-arith.toml", tmp_path, *SHORT, "algo.advantage=reinforce_pp",
                   "algo.kl_beta=0.1", "algo.clip_ratio_c=3", "algo.max_off_policy_steps=1",
                   "algo.loss_agg=seq_mean_token_sum")
    assert done.returncode == 0, done.stdout + done.stderr
    steps = _metrics(tmp_path)
    assert len(steps) == 2
    for r in steps:
        assert 0 <= r["loss/dual_clip_frac"] <= 1 and r["kl"] >= 0
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "adv_abs_mean"))
