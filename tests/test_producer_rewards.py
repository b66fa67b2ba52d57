"""Rewards computed by the producer (``algo.max_off_policy_steps = k >= 1``): each batch sampled
ahead is rewarded on the producer thread right after it is sampled, the first batch and those
a checkpoint held on the training thread, with the same results (a run resumed from a
checkpoint, whose batch in flight is rewarded on the training thread, ends bitwise where the
uninterrupted run did); the producer's reward seconds in ``time/reward``; a reward failure in
the producer ends the run at the step of its batch with the one-line error."""

from __future__ import annotations

import shutil

import attrs
import pytest

from runner.errors import RewardFailure, RuntimeFailure
from runner.train.loops.pipeline import Produced, Producer
from runner.train.loops.trajectory import Trajectory
from tests.extmods.thread_rewards import LOG
from tests.resume_helpers import assert_same_run, rows, run_cli

GRPO = "recipes/grpo-arith.toml"
SMALL = ("algo.prompts_per_step=4", "algo.group_size=4", "rollout.max_new_tokens=4",
         "data.validation.enabled=false", "logging.sample_every=0", "train.lr=3e-3",
         "algo.engine_is_correction=true", "algo.max_off_policy_steps=1")
RECORDED = ("reward.functions=['tests.extmods.thread_rewards.recorded']", "reward.timeout_s=0")


def _threads(out) -> list[str]:
    """The thread of each reward call of the run in ``out``, in order."""
    return [line.split()[0] for line in (out / LOG).read_text().splitlines()]


def _empty(step: int) -> tuple[Trajectory, list[int]]:
    return Trajectory((), (), ()), []


def test_batches_sampled_ahead_are_rewarded_on_the_producer_thread_alike(tmp_path):
    """k = 1, 4 steps: step 1's batch is rewarded on the training thread (sampled there), those
    of steps 2-4 on the producer thread that sampled them. Resumed from the checkpoint of step 2
    (step 3's batch in flight, read back without rewards): that batch is rewarded on the
    training thread, step 4's on the producer's, and the run ends bitwise where the
    uninterrupted one did (rewards, every other metric, weights, optimizer state)."""
    straight = tmp_path / "straight"
    args = ("run.max_steps=4", *SMALL, *RECORDED, "checkpoint.every_steps=1",
            "checkpoint.keep_last=10")
    done = run_cli(GRPO, straight, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _threads(straight) == ["MainThread", "producer-step-2", "producer-step-3",
                                  "producer-step-4"]
    trained = [r for r in rows(straight) if "loss" in r]
    assert [r["rollout/staleness_max"] for r in trained] == [0.0, 1.0, 1.0, 1.0]
    assert len({r["reward/mean"] for r in trained}) > 1  # rewards that vary: the runs learn
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for step in (3, 4):
        shutil.rmtree(resumed / "checkpoints" / f"step-{step:06d}")
    (resumed / LOG).unlink()
    done = run_cli(GRPO, resumed, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming" in done.stdout
    assert _threads(resumed) == ["MainThread", "producer-step-4"]
    assert_same_run(resumed, straight, 4, ("model/model.safetensors", "optimizer.safetensors"))


def test_the_producers_reward_seconds_are_the_steps_reward_time(tmp_path):
    """A reward that sleeps 0.3 s per batch: ``time/reward`` (the whole scoring stage) and
    ``time/reward_ahead`` (the producer's part) are at least 0.3 s at every step: step 1's
    batch was sampled and rewarded by ``take`` (within ``time/rollout_wait``), the later ones
    by the producer thread while the step before trained, so the training thread waited for
    them (at the end of that step, then at the start of theirs) less than the producer worked
    on them. The margin is the training thread's own work, made about 0.1 s a step here
    (4 epochs), which a loaded machine only lengthens."""
    done = run_cli(GRPO, tmp_path, "run.max_steps=3", *SMALL, "reward.timeout_s=0",
                   "algo.ppo_epochs=4", "reward.functions=['tests.extmods.thread_rewards.slow']")
    assert done.returncode == 0, done.stdout + done.stderr
    trained = [r for r in rows(tmp_path) if "loss" in r]
    assert all(r["time/reward"] >= r["time/reward_ahead"] >= 0.3 for r in trained), trained
    assert trained[0]["time/rollout_wait"] >= 0.3
    # step t's last wait and step t + 1's first are for step t + 1's batch
    waited = sum(before["time/producer_wait"] + after["time/rollout_wait"]
                 for before, after in zip(trained[:-1], trained[1:], strict=True))
    worked = sum(r["time/rollout"] + r["time/reward_ahead"] for r in trained[1:])
    assert waited < worked, trained


def test_a_reward_failure_in_the_producer_ends_the_run_at_its_batchs_step(tmp_path):
    """Process isolation with ``on_error = "fail"``: every sample of step 2's batch (rewarded by
    the producer while step 1 trains) raises. Step 1 ends, is logged and checkpointed (holding
    step 2's batch in flight); step 2 fails with the one-line error naming the function, the
    item and the step (exit 1)."""
    import json

    name = "tests.extmods.thread_rewards.fails_after_first_batch"
    done = run_cli(GRPO, tmp_path, "run.max_steps=3", *SMALL, f"reward.functions=['{name}']",
                   "reward.isolation=process", "reward.workers=1", "reward.on_error=fail",
                   "checkpoint.every_steps=1")
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: reward at step 2: {name} at item 0: raised ValueError: "
                           "sample 17 is past the first batch"), done.stderr
    assert [r["step"] for r in rows(tmp_path) if "loss" in r] == [1]
    state = json.loads((tmp_path / "checkpoints" / "step-000001" / "state.json").read_text())
    assert [b["step"] for b in state["in_flight"][0]] == [2]


def test_the_producer_rewards_each_batch_where_it_samples_it():
    """Unit: the reward stage runs with the batch's own step, on the producer thread for the
    batches it samples and on the calling thread for those ``take`` samples; the batches a
    checkpoint held are rewarded by ``take``, in step order, before it hands out the first."""
    import threading

    seen = []

    def reward(traj: Trajectory, step: int) -> Trajectory:
        seen.append((threading.current_thread().name, step))
        return attrs.evolve(traj, rewards=(float(step),), rewarded=True)

    producer = Producer(_empty, 1, reward=reward)
    got = producer.take(1)
    assert got.traj.rewards == (1.0,) and got.reward_seconds > 0
    producer.start(2, version=0)
    producer.wait()
    assert producer.take(2).traj.rewards == (2.0,)
    assert seen == [("MainThread", 1), ("producer-step-2", 2)]

    seen.clear()
    held = [Produced(s, s - 3, Trajectory((), (), ()), (), 0.0) for s in (4, 5)]
    producer = Producer(_empty, 2, in_flight=held, reward=reward)
    assert producer.take(4).traj.rewards == (4.0,)
    assert seen == [("MainThread", 4), ("MainThread", 5)]
    producer.start(6, version=3)
    producer.wait()
    assert producer.take(5).traj.rewards == (5.0,)
    assert seen[2:] == [("producer-step-6", 6)]
    # a batch rewarded already is not rewarded again
    assert producer._rewarded(producer.ahead[0]) is producer.ahead[0]


@pytest.mark.parametrize("raised", ["reward failure", "other"])
def test_a_reward_failure_is_raised_by_the_step_that_takes_the_batch(raised):
    """The producer's reward stage fails on step 2's batch: ``wait`` (the end of step 1) does
    not raise, the batch stays ahead unrewarded (a checkpoint holds it), and ``take(2)`` raises
    the RewardFailure as it is, or another exception named as the producer's."""
    failure = RewardFailure(2, [("judge", 3, "raised ValueError: no at item 3 of 4")])

    def reward(traj: Trajectory, step: int) -> Trajectory:
        if step == 2:
            if raised == "other":
                raise KeyError("gone")
            raise failure
        return attrs.evolve(traj, rewarded=True)

    producer = Producer(_empty, 1, reward=reward)
    producer.take(1)
    producer.start(2, version=0)
    producer.wait()
    assert [b["step"] for b in producer.to_json()] == [2]
    assert not producer.ahead[0].traj.rewarded
    if raised == "other":
        with pytest.raises(RuntimeFailure, match=r"^producer at step 2: rewarding failed: "
                           r"KeyError: 'gone'$"):
            producer.take(2)
    else:
        with pytest.raises(RewardFailure) as info:
            producer.take(2)
        assert info.value is failure
        assert str(failure) == "reward at step 2: judge raised ValueError: no at item 3 of 4"
