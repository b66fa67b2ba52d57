"""Rollouts that overlap training (``algo.max_off_policy_steps``): the fixed schedule's
staleness, runs bitwise reproducible, the same items in the same order as the synchronous loop,
SIGKILL and resume with batches in flight bitwise equal to the uninterrupted run, two torchrun
ranks, the vllm engine sampling ahead with the weights of the schedule, refusals, a producer
that fails ending the step with its name, the producer on the rank's CUDA device, and the loss
of a stale batch derived by hand."""

from __future__ import annotations

import random

import pytest

from runner.errors import RuntimeFailure
from runner.train.loops.pipeline import Producer
from runner.train.loops.trajectory import Trajectory
from tests.multiproc import run_ranks
from tests.resume_helpers import (
    assert_same_run,
    deterministic_rows,
    kill_at_random_points,
    run_cli,
)

GRPO = "recipes/grpo-arith.toml"
STEPS = 5
SMALL = ("algo.prompts_per_step=4", "algo.group_size=4", "rollout.max_new_tokens=4",
         "data.validation.size=8", "train.eval_every=2", "checkpoint.every_steps=1",
         "checkpoint.keep_last=10", "logging.sample_every=0", "logging.item_ids=true",
         "algo.engine_is_correction=true", "train.lr=3e-3")
K1 = ("algo.max_off_policy_steps=1",)


def _trained(out) -> list[dict]:
    return [r for r in deterministic_rows(out) if "loss" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted k = 1 run, and the synchronous run of the same recipe."""
    runs = {}
    for name, extra in (("k1", K1), ("k0", ())):
        out = tmp_path_factory.mktemp(name)
        done = run_cli(GRPO, out, f"run.max_steps={STEPS}", *SMALL, *extra)
        assert done.returncode == 0, done.stdout + done.stderr
        runs[name] = out
    return runs


def test_staleness_follows_the_schedule_and_the_items_are_the_synchronous_runs(straight):
    rows = _trained(straight["k1"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["rollout/staleness_max"] for r in rows] == [0.0] + [1.0] * (STEPS - 1)
    assert [r["rollout/staleness_mean"] for r in rows] == [0.0] + [1.0] * (STEPS - 1)
    # the producer reads the one cursor in the same order: every step trains the same items
    sync = _trained(straight["k0"])
    assert [r["data/item_ids"] for r in rows] == [r["data/item_ids"] for r in sync]
    assert all("rollout/staleness_max" not in r for r in sync)
    # the first batch is on-policy, so its step equals the synchronous run's; later ones differ
    assert rows[0]["loss"] == sync[0]["loss"]
    assert rows[-1]["loss"] != sync[-1]["loss"]


def test_two_runs_are_bitwise_equal(straight, tmp_path):
    done = run_cli(GRPO, tmp_path, f"run.max_steps={STEPS}", *SMALL, *K1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_run(tmp_path, straight["k1"], STEPS, ("model/model.safetensors",
                                                      "optimizer.safetensors"))


@pytest.mark.slow
def test_killed_with_batches_in_flight_then_resumed_equals_the_uninterrupted_run(straight,
                                                                                  tmp_path):
    """SIGKILL at random points (mid-checkpoint write, mid-step with the producer sampling or
    holding a batch), then resumes: rows, weights, optimizer state and state.json (with the
    batches in flight) bitwise the uninterrupted run's."""
    where = kill_at_random_points(GRPO, tmp_path, STEPS, (*SMALL, *K1), random.Random(2), 2)
    assert where and not all(w.endswith("(the run had finished)") for w in where), where
    done = run_cli(GRPO, tmp_path, f"run.max_steps={STEPS}", *SMALL, *K1)
    assert done.returncode == 0, (where, done.stdout + done.stderr)
    assert "resuming" in done.stdout, where
    assert_same_run(tmp_path, straight["k1"], STEPS, ("model/model.safetensors",
                                                      "optimizer.safetensors"))


@pytest.mark.multiproc
def test_two_torchrun_ranks_with_k_2(straight, tmp_path):
    """k = 2 on two ranks: the schedule, the synchronous run's items, and a resume from the
    checkpoint of step 1 (every rank's batches of steps 2 and 3 in flight) ends bitwise where
    the uninterrupted run did."""
    import shutil

    k2 = (GRPO, "run.max_steps=3", *SMALL, "algo.max_off_policy_steps=2")
    done = run_ranks(k2[0], tmp_path / "a", 2, *k2[1:])
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _trained(tmp_path / "a")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 2.0]
    sync = _trained(straight["k0"])[:3]
    assert [r["data/item_ids"] for r in rows] == [r["data/item_ids"] for r in sync]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for step in (2, 3):  # back to the checkpoint of step 1
        shutil.rmtree(tmp_path / "b" / "checkpoints" / f"step-{step:06d}")
    done = run_ranks(k2[0], tmp_path / "b", 2, *k2[1:])
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_run(tmp_path / "b", tmp_path / "a", 3)


def test_refusals(straight, tmp_path):
    # a checkpoint with a batch in flight is not resumed by the synchronous loop (its items
    # would be skipped)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(straight["k1"], copy)
    shutil.rmtree(copy / "checkpoints" / f"step-{STEPS:06d}")
    done = run_cli(GRPO, copy, f"run.max_steps={STEPS}", *SMALL)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "algo.max_off_policy_steps" in done.stderr and "sampled ahead" in done.stderr
    # nor by a run that samples further ahead: the checkpoint records the k that wrote it
    done = run_cli(GRPO, copy, f"run.max_steps={STEPS}", *SMALL, "algo.max_off_policy_steps=2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        f"algo.max_off_policy_steps: the checkpoint step-{STEPS - 1:06d} holds 1 batch(es) "
        "sampled ahead by 1 rank(s) with max_off_policy_steps = 1, which this run "
        "(max_off_policy_steps = 2, 1 rank(s)) would not train (got 2). Resume with the "
        "max_off_policy_steps and number of ranks that wrote it."), done.stderr


@pytest.mark.parametrize(("flights", "world"), [([[{}], [{}]], 1), ([[{}]], 2)])
def test_batches_in_flight_on_another_number_of_ranks_are_refused(flights, world):
    """Refused before any model is built, counting the batches of every rank that wrote the
    checkpoint (every rank of the new world, one the checkpoint has no list for too)."""
    from pathlib import Path
    from types import SimpleNamespace as NS

    from runner.errors import RecipeError
    from runner.train.loops.pipeline import refuse_in_flight

    ckpt = NS(path=Path("step-000003"), state=NS(in_flight=flights, off_policy_steps=1))
    with pytest.raises(RecipeError) as info:
        refuse_in_flight(ckpt, 1, world)
    held = sum(map(len, flights))
    assert info.value.problems[0].message == (
        f"the checkpoint step-000003 holds {held} batch(es) sampled ahead by {len(flights)} "
        f"rank(s) with max_off_policy_steps = 1, which this run (max_off_policy_steps = 1, "
        f"{world} rank(s)) would not train")
    refuse_in_flight(ckpt, 1, len(flights))  # the world that wrote it: accepted


@pytest.mark.vllm
def test_the_vllm_engine_samples_ahead_with_the_scheduled_weights(straight, tmp_path):
    """vLLM generates on the producer thread while the step trains (with keys of the GRPO
    family): the staleness schedule, the synchronous run's items, and the batch of step 3
    (held by the checkpoint of step 2) was sampled by the weights of step 1: its logprobs are
    theirs (float32 numerics apart), not those of step 2. (Two such runs were bitwise equal
    when measured; not repeated here.)"""
    import importlib.util
    import json

    import torch
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("vllm") is None:  # (not imported here: 2 s)
        pytest.skip("vllm is not installed")
    # (the training items stay the same; the GRPO family's keys change the loss alone: RLOO's
    # baseline, CISPO's loss with a dual clip, overlong shaping, truncated completions masked)
    done = run_cli(GRPO, tmp_path, "run.max_steps=3", *SMALL, *K1, "rollout.engine=vllm",
                   "data.validation.enabled=false", "algo.advantage=rloo",
                   "algo.policy_loss=cispo", "reward.overlong_buffer_len=2",
                   "reward.overlong_penalty=0.5", "algo.mask_truncated=true")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _trained(tmp_path)
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("reward/overlong_penalty" in r for r in rows)
    sync = _trained(straight["k0"])[:3]
    assert [r["data/item_ids"] for r in rows] == [r["data/item_ids"] for r in sync]
    ckpts = tmp_path / "checkpoints"
    (batch,) = json.loads((ckpts / "step-000002" / "state.json").read_text())["in_flight"][0]
    assert (batch["step"], batch["version"]) == (3, 1)

    def gap(step: int) -> float:  # the largest |engine - policy| logprob (temperature 1)
        model = AutoModelForCausalLM.from_pretrained(ckpts / f"step-{step:06d}" / "model",
                                                     dtype=torch.float32)
        worst = 0.0
        with torch.no_grad():
            for prompt, (ids, _, engine, _) in zip(batch["prompt_ids"], batch["completions"],
                                                   strict=True):
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
                worst = max(worst, float((lp - torch.tensor(engine)).abs().max()))
        return worst

    assert gap(1) < 1e-4 < 0.01 < gap(2)


@pytest.mark.vllm
def test_the_vllm_engine_draws_dynamic_samples_ahead(tmp_path):
    """DAPO's recipe (dynamic sampling, overlong shaping) with vLLM sampling one step ahead: the
    producer draws each step's batches (up to max_sample_batches) with the engine of the
    scheduled version, every step trains the groups it kept, and the engine stays in sync with
    the policy (the correction's logprob gap is float32's)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    done = run_cli("recipes/grpo-dapo-arith.toml", tmp_path, "run.max_steps=3", *SMALL, *K1,
                   "rollout.engine=vllm", "data.validation.enabled=false",
                   "algo.max_sample_batches=3")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _trained(tmp_path)
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    consumed: list[int] = []
    for r in rows:  # whole batches of 4 prompts drawn; at most 4 groups kept, from those drawn
        assert r["sampling/items_consumed"] == len(r["data/items_consumed"])
        assert r["sampling/items_consumed"] == 4 * (1 + r["sampling/extra_batches"]) <= 12
        assert len(r["data/item_ids"]) == r["sampling/kept_groups"] <= 4
        assert set(r["data/item_ids"]) <= set(r["data/items_consumed"])
        consumed += r["data/items_consumed"]
    # Step 1's batches were sampled by the weights it trains: the engine's logprobs are the
    # policy's (float32 numerics apart); later batches by the weights one step behind.
    assert rows[0]["rollout/logprob_gap"] < 1e-4, [r["rollout/logprob_gap"] for r in rows]
    assert len(set(consumed)) == len(consumed)  # the cursor never draws an item twice


def test_a_failing_producer_ends_the_step_naming_itself():
    def sample(step: int) -> tuple[Trajectory, list[int]]:
        if step == 3:
            raise ValueError("the engine went away")
        return Trajectory((), (), ()), []

    producer = Producer(sample, 1)
    assert producer.take(1).step == 1
    producer.start(2, version=0)
    assert producer.take(2).version == 0
    producer.start(3, version=1)
    with pytest.raises(RuntimeFailure, match="producer at step 3: sampling failed: ValueError: "
                       "the engine went away"):
        producer.wait()


def test_the_producer_never_samples_past_the_last_step():
    """k = 300 on a 2-step run: the first take samples steps 1 and 2 only, and a start past
    the last step samples nothing."""
    sampled = []

    def sample(step: int) -> tuple[Trajectory, list[int]]:
        sampled.append(step)
        return Trajectory((), (), ()), []

    producer = Producer(sample, 300, last_step=2)
    assert producer.take(1).step == 1 and sampled == [1, 2]
    producer.start(3, version=1)
    producer.wait()
    assert producer.take(2).step == 2 and sampled == [1, 2]


@pytest.mark.slow
def test_ppo_with_k_1_killed_and_resumed_equals_its_uninterrupted_run(tmp_path):
    """PPO (policy and critic) with a batch in flight: the staleness schedule, and a kill
    after a checkpoint resumed bitwise (the critic's weights too)."""
    ppo = ("recipes/ppo-arith.toml", "algo.prompts_per_step=4", "rollout.max_new_tokens=4",
           "data.validation.enabled=false", "checkpoint.every_steps=1", "checkpoint.keep_last=10",
           "logging.sample_every=0", "logging.item_ids=true", *K1)
    straight = tmp_path / "straight"
    done = run_cli(ppo[0], straight, "run.max_steps=4", *ppo[1:])
    assert done.returncode == 0, done.stdout + done.stderr
    assert [r["rollout/staleness_max"] for r in _trained(straight)] == [0.0, 1.0, 1.0, 1.0]
    out = tmp_path / "killed"
    where = kill_at_random_points(ppo[0], out, 4, ppo[1:], random.Random(2), 1)
    assert where and not where[0].endswith("(the run had finished)"), where
    done = run_cli(ppo[0], out, "run.max_steps=4", *ppo[1:])
    assert done.returncode == 0, (where, done.stdout + done.stderr)
    assert_same_run(out, straight, 4, ("model/model.safetensors",
                                       "extra_models/critic/model.safetensors"))


def test_dry_run_shows_the_pipeline(tmp_path):
    done = run_cli(GRPO, tmp_path, "--dry-run", *K1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rollouts ahead" in done.stdout and "1 batch(es)" in done.stdout
    assert "producer threads" in done.stdout


def test_the_producer_samples_with_its_own_thread_count():
    import torch

    main = torch.get_num_threads()
    seen = []

    def sample(step: int) -> tuple[Trajectory, list[int]]:
        seen.append(torch.get_num_threads())
        return Trajectory((), (), ()), []

    producer = Producer(sample, 1, threads=1)
    producer.take(1)  # sampled here, on the training thread
    producer.start(2, version=0)
    producer.wait()
    assert seen == [main, 1] and torch.get_num_threads() == main


def test_the_loss_of_a_stale_batch_is_the_hand_derived_decoupled_ppo_loss():
    """At k >= 1 the loss compares three policies (grpo_loss with engine_is_weights, as
    runner/train/loops/grpo.py's minibatch_loss calls them): pi (the weights being trained),
    pi_prox (the same weights before the step: old_logprobs = 'policy') and pi_engine (the
    engine that sampled the batch k versions ago). Token loss:

        l = -w min(r A, clip(r, 1 - 0.2, 1 + 0.25) A),  r = pi / pi_prox,
        w = min(pi_prox / pi_engine, cap = 2).

    Two sequences of 3 tokens; the last token of row 1 is masked out (r = 10, w = 0.1 there:
    ignored).

        row 0, A = +1:   pi     pi_prox pi_engine   r     w         l
          t0            0.75    0.5     0.5        1.5   1         -1 * min(1.5, 1.25) = -1.25
          t1            0.5     0.5     0.125      1     4 -> 2    -2 * min(1, 1)      = -2
          t2            0.25    0.5     1          0.5   0.5       -0.5 * min(0.5, 0.8) = -0.25
        row 1, A = -0.5:
          t0            0.2     0.5     0.625      0.4   0.8       -0.8 * min(-0.2, -0.4) = 0.32
          t1            0.5     0.25    0.0625     2     4 -> 2    -2 * min(-1, -0.625)   = 2

    token_mean: (-1.25 - 2 - 0.25 + 0.32 + 2) / 5 = -1.18 / 5 = -0.236
    seq_mean:   (-3.5 / 3 + 2.32 / 2) / 2 = (-7/6 + 29/25) / 2 = (-1/150) / 2 = -1/300
    dr_grpo:    -1.18 / (2 rows x max_tokens 4) = -0.1475
    clip_frac = 2/5 (row 0 t0: A > 0, r > 1.25; row 1 t0: A < 0, r < 0.8), ratio_mean =
    (1.5 + 1 + 0.5 + 0.4 + 2) / 5 = 1.08, engine_is_weight = (1 + 2 + 0.5 + 0.8 + 2) / 5 = 1.26.
    Gradient of token_mean by log pi: -w r A / 5 where unclipped, 0 where clipped:
    row 0: 0, -2 * 1 * 1 / 5 = -0.4, -0.5 * 0.5 * 1 / 5 = -0.05; row 1: 0, -2 * 2 * -0.5 / 5 = 0.4.
    """
    import math

    import torch

    from runner.algorithms.grpo import GRPOLossInputs, engine_is_weights, grpo_loss
    from runner.recipe.schema import GRPOConfig

    def logs(rows):
        return torch.tensor([[math.log(p) for p in row] for row in rows], dtype=torch.float64)

    pi = logs([[0.75, 0.5, 0.25], [0.2, 0.5, 0.5]]).requires_grad_()
    prox = logs([[0.5, 0.5, 0.5], [0.5, 0.25, 0.05]])
    engine = logs([[0.5, 0.125, 1.0], [0.625, 0.0625, 0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    w = engine_is_weights(prox, engine, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1, 2, 0.5], [0.8, 2, 0.1]],
                                               dtype=torch.float64), rtol=0, atol=1e-12)
    expected = {"token_mean": -0.236, "seq_mean": -1 / 300, "dr_grpo": -0.1475}
    for agg, value in expected.items():
        cfg = GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.25, loss_agg=agg,
                         engine_is_correction=True, engine_is_cap=2.0)
        loss, metrics = grpo_loss(GRPOLossInputs(logprobs_BT=pi, old_logprobs_BT=prox, adv_B=adv,
                                                 mask_BT=mask, max_tokens=4, is_weights_BT=w),
                                  cfg)
        assert loss.dtype == torch.float64
        assert abs(loss.item() - value) < 1e-12, (agg, loss.item())
        assert abs(metrics["pg_loss"].item() - value) < 1e-12
        assert abs(metrics["clip_frac"].item() - 0.4) < 1e-7  # a float32 mean of the flags
        assert abs(metrics["ratio_mean"].item() - 1.08) < 1e-12
        assert abs(metrics["engine_is_weight"].item() - 1.26) < 1e-12
        if agg == "token_mean":
            (grad,) = torch.autograd.grad(loss, pi)
            torch.testing.assert_close(grad, torch.tensor([[0, -0.4, -0.05], [0, 0.4, 0]],
                                                          dtype=torch.float64),
                                       rtol=0, atol=1e-12)


def test_the_producer_thread_samples_on_the_training_threads_cuda_device(monkeypatch):
    """CUDA's current device is per thread, so the producer takes the one the training thread
    chose (a torchrun rank's own GPU); CUDA faked: its calls are recorded."""
    import torch

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    producer = Producer(lambda step: (Trajectory((), (), ()), []), 1)
    producer.take(1)
    producer.start(2, version=0)
    producer.wait()
    assert chosen == [3]


def test_opd_samples_ahead_and_weighs_stale_samples_against_the_engine(tmp_path):
    """OPD with k = 1: the schedule, and the ratio of a stale batch is taken against the
    engine's logprobs (1 within float noise for the first, fresh batch; not 1 once stale)."""
    opd = ("recipes/opd-arith.toml", "algo.prompts_per_step=4", "rollout.max_new_tokens=4",
           "data.validation.enabled=false", "logging.sample_every=0", *K1)
    done = run_cli(opd[0], tmp_path, "run.max_steps=3", *opd[1:])
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _trained(tmp_path)
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert abs(rows[0]["ratio_mean"] - 1) < 1e-4
    assert all(abs(r["ratio_mean"] - 1) > 1e-3 for r in rows[1:])
