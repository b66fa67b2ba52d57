"""DAPO's dynamic sampling with rollouts that overlap training (``algo.dynamic_sampling =
"filter"`` with ``algo.max_off_policy_steps = k >= 1``): the producer draws each step's batches
by the rule of ``runner/train/loops/dynamic.py``, so the items a step consumes and trains on are
the hand-built lists of ``tests/test_dynamic_sampling.py`` (the reward pattern is fixed by the
data alone), and a batch sampled by the same policy version keeps the same groups as the
synchronous run's; 1 rank against 2 (and a 2-rank resume with draws in flight); a SIGKILLed run
resumed bitwise; the producer's checkpointed draws, its failures and the refusals.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from runner.errors import RecipeError, RuntimeFailure
from runner.rollout.base import Completion
from runner.train.loops import dynamic, grpo
from runner.train.loops.pipeline import Produced
from runner.train.loops.trajectory import Trajectory
from tests.multiproc import run_ranks
from tests.resume_helpers import (
    assert_same_run,
    deterministic_rows,
    final_weights,
    kill_at_random_points,
    run_cli,
)
from tests.test_dynamic_sampling import DYN, F64, GRPO, P, _reward, expected
from tests.tiny_run import tiny_run

DECIDED = dynamic.decided  # (the test wraps it)


def _steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rule: str, *overrides: str
           ) -> tuple[list[dict], list[dynamic.Drawn], list]:
    """Steps 1-3 of a one-rank run in this process (the producer given its draw, as the GRPO
    loop gives it): their metrics, what each step decided (``dynamic.decided``) and the
    hand-built lists of ``expected``."""
    decided = []

    def recorded(*args):
        decided.append(DECIDED(*args))
        return decided[-1]

    monkeypatch.setattr(dynamic, "decided", recorded)
    with tiny_run("grpo-arith", tmp_path, *DYN, _reward(rule), "run.max_steps=3",
                  *overrides) as run:
        algo, rewards = run.svc.recipe.algo, run.roles.rewards
        dynamic.sample_ahead_with(run, algo, rewards)
        rows = [grpo.one_step(run, algo, rewards, step) for step in (1, 2, 3)]
        want = expected(run.state.data.source, run.svc.recipe.run.seed, rule, 3, 3)
    return rows, decided, want


def _groups(drawn: dynamic.Drawn) -> list[tuple]:
    """The kept groups' items, completions and rewards, and every completion drawn."""
    t = drawn.traj
    return [t.items, t.completions, t.rewards, drawn.drawn.completions, drawn.drawn.rewards]


RULE = "ties_on_multiples_of_3"


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    """The synchronous run's steps 1-3 under ``RULE`` (what ``_steps`` returns), run once for
    every k it is compared with."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _steps(tmp_path_factory.mktemp("sync"), monkeypatch, RULE)


@pytest.mark.parametrize("k", [1, 2])
def test_the_producer_draws_the_hand_built_items_and_the_synchronous_groups(tmp_path,
                                                                            monkeypatch, k,
                                                                            synchronous):
    """Groups of answers divisible by 3 are dropped. Sampling k steps ahead, every step
    consumes and trains the hand-built items (which batches were drawn, which groups kept),
    logged with the step that trains them; step 1's batch is sampled by version 0 as the
    synchronous run's is, so its drawn and kept groups and its loss are that run's."""
    sync, sync_drawn, want = synchronous
    rows, drawn, _ = _steps(tmp_path / f"k{k}", monkeypatch, RULE,
                            f"algo.max_off_policy_steps={k}")
    for got in (rows, sync):
        assert [r["data/items_consumed"] for r in got] == [c for c, _, _ in want]
        assert [r["data/item_ids"] for r in got] == [kept for _, kept, _ in want]
        assert [r["sampling/extra_batches"] for r in got] == [float(n - 1) for *_, n in want]
        assert [r["sampling/items_consumed"] for r in got] == [float(len(c)) for c, *_ in want]
        assert [r["sampling/kept_groups"] for r in got] == [float(P)] * 3
    assert any(n > 1 for *_, n in want)
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, float(min(k, 2))]
    assert _groups(drawn[0]) == _groups(sync_drawn[0])
    assert [d.traj.rewards for d in drawn] == [d.traj.rewards for d in sync_drawn]
    assert rows[0]["loss"] == sync[0]["loss"] and rows[0]["grad_norm"] == sync[0]["grad_norm"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_one_rank_and_two_ranks_draw_ahead_the_same(tmp_path):
    """k = 1 in float64 (as ``tests/test_dynamic_sampling.py`` compares the synchronous runs):
    the same items, kept groups and sampling metrics on 1 and 2 ranks, the losses and weights
    to rounding; the cap keeps 3, 1, 1 groups (at 1 kept group a rank pads). Then the 2-rank
    run resumed from its checkpoint of step 1 (each rank's draws of step 2 in flight) ends
    bitwise where it did."""
    args = ("run.max_steps=3", *DYN, *F64, _reward("ties_unless_multiple_of_4"),
            "algo.max_sample_batches=2", "algo.max_off_policy_steps=1")
    for world in (1, 2):
        done = run_ranks(GRPO, tmp_path / f"w{world}", world, *args)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "step 2: dynamic sampling kept 1 of 4 groups in 2 batch(es)" in done.stdout
    one, two = (deterministic_rows(tmp_path / f"w{w}") for w in (1, 2))
    keys = ("data/items_consumed", "data/item_ids", "sampling/kept_groups",
            "sampling/filtered_frac", "sampling/extra_batches", "reward/mean",
            "rollout/staleness_max")
    assert [[r.get(k) for k in keys] for r in one] == [[r.get(k) for k in keys] for r in two]
    trained = [r for r in one if "loss" in r]
    assert [r["sampling/kept_groups"] for r in trained] == [3.0, 1.0, 1.0]
    assert [r["rollout/staleness_max"] for r in trained] == [0.0, 1.0, 1.0]
    for a, b in zip(trained, (r for r in two if "loss" in r), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * max(1.0, abs(a["loss"])), (a, b)
    a, b = final_weights(tmp_path / "w1", 3), final_weights(tmp_path / "w2", 3)
    worst = max(float((b[k] - a[k]).norm() / a[k].norm()) for k in a if a[k].norm() > 0)
    assert worst < 1e-10, worst
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "w2", resumed)
    for step in (2, 3):  # back to the checkpoint of step 1
        shutil.rmtree(resumed / "checkpoints" / f"step-{step:06d}")
    done = run_ranks(GRPO, resumed, 2, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_run(resumed, tmp_path / "w2", 3, ("model/model.safetensors",
                                                  "optimizer.safetensors"))


@pytest.mark.slow
def test_sigkill_at_random_points_with_draws_in_flight_then_resume_bitwise(tmp_path):
    """Random(7) aims both kills at checkpoint writes (a tiny run's steps are over before a
    random delay ends), each while the producer's draws of the next step are in flight."""
    n = 5
    small = (*DYN, _reward("ties_on_multiples_of_3"), "algo.max_off_policy_steps=1",
             "algo.engine_is_correction=true", "data.validation.size=8", "train.eval_every=2",
             "checkpoint.every_steps=1", "checkpoint.keep_last=3", "logging.sample_every=0")
    straight = tmp_path / "straight"
    done = run_cli(GRPO, straight, f"run.max_steps={n}", *small)
    assert done.returncode == 0, done.stdout + done.stderr
    state = json.loads((straight / "checkpoints" / "step-000003" / "state.json").read_text())
    (held,) = state["in_flight"][0]  # step 4's draws: two batches of P prompts, rewarded
    assert (held["step"], held["version"], len(held["rewards"])) == (4, 2, 2 * P * 2)
    out = tmp_path / "killed"
    where = kill_at_random_points(GRPO, out, n, small, random.Random(7), kills=2)
    assert where and not all(w.endswith("(the run had finished)") for w in where), where
    done = run_cli(GRPO, out, f"run.max_steps={n}", *small)
    assert done.returncode == 0, (where, done.stdout + done.stderr)
    assert "resuming" in done.stdout, where
    try:
        assert_same_run(out, straight, n, ("model/model.safetensors", "optimizer.safetensors"))
    except AssertionError as exc:
        raise AssertionError(f"after kills at {where}: {exc}") from exc
    trained = [r for r in deterministic_rows(out) if "loss" in r]
    assert [r["sampling/extra_batches"] for r in trained] == [1.0] * n
    assert [r["rollout/staleness_max"] for r in trained] == [0.0] + [1.0] * (n - 1)


def _batch(rewards: tuple[float, ...]) -> Trajectory:
    completions = tuple(Completion((5, 2), "7", (-0.5, -0.25), "stop") for _ in rewards)
    return Trajectory((None,) * len(rewards), ((1, 3),) * len(rewards), completions,
                      rewards=rewards, reward_parts={"reward/x": 0.5}, rewarded=True)


def test_a_checkpoint_keeps_the_draws_rewards_and_reads_them_back():
    produced = Produced(4, 2, _batch((0.0, 1.0, 0.25, 0.25)), (8, 8, 3, 3), 1.5,
                        keeps_rewards=True)
    raw = json.loads(json.dumps(produced.to_json()))
    assert raw["rewards"] == [0.0, 1.0, 0.25, 0.25] and raw["reward_parts"] == {"reward/x": 0.5}
    back = Produced.from_json(raw, lambda i: f"item {i}")
    assert back.keeps_rewards and back.traj.rewarded
    assert back.traj.items == ("item 8", "item 8", "item 3", "item 3")
    assert (back.traj.rewards, back.traj.reward_parts) == (produced.traj.rewards,
                                                           produced.traj.reward_parts)
    assert back.traj.completions == produced.traj.completions
    plain = Produced(4, 2, _batch((0.0, 1.0)), (8, 8), 1.5).to_json()
    assert "rewards" not in plain  # a plain producer's batch is rewarded again on resume


class _Side:
    """A stand-in for the producer's process group of 2 ranks: rank 1 answers ``other``."""

    def __init__(self, other):
        self.other, self.sent = other, []

    def gather(self, value):
        self.sent.append(value)
        return [value, self.other]


ALGO = NS(prompts_per_step=2, group_size=2, max_sample_batches=3)


def test_a_draw_that_fails_on_one_rank_ends_every_ranks_draw(monkeypatch):
    """The failing rank tells the others (its gather sends None) and raises its own error; a
    rank told so raises a failure naming the rank, instead of waiting in its next gather."""
    monkeypatch.setattr(dynamic, "draw_batch",
                        lambda run, algo, rewards, step, drawn: (_batch((0.0, 1.0)), [4, 4]))
    side = _Side(None)
    with pytest.raises(RuntimeFailure, match="producer at step 5: dynamic sampling's draw "
                       "failed on rank 1"):
        dynamic.draw_ahead(None, ALGO, None, 5, side)
    assert side.sent == [[True]]

    def fails(*args):
        raise ValueError("the engine went away")

    monkeypatch.setattr(dynamic, "draw_batch", fails)
    side = _Side([True])
    with pytest.raises(ValueError, match="the engine went away"):
        dynamic.draw_ahead(None, ALGO, None, 5, side)
    assert side.sent == [None]


def test_the_producer_stops_drawing_on_every_ranks_verdicts(monkeypatch):
    """Rank 0's first batch has an informative group, rank 1's none: 1 of 2 kept, so a second
    batch is drawn; there rank 1 keeps one: 2 kept, the draw stops at 2 batches."""
    batches = iter([_batch((0.0, 1.0)), _batch((0.0, 0.0))])
    monkeypatch.setattr(dynamic, "draw_batch",
                        lambda run, algo, rewards, step, drawn: (next(batches), [drawn] * 2))
    answers = iter([[False], [True]])

    class Side:
        def gather(self, value):
            return [value, next(answers)]

    traj, indices = dynamic.draw_ahead(None, ALGO, None, 5, Side())
    assert traj.rewards == (0.0, 1.0, 0.0, 0.0) and indices == [0, 0, 1, 1] and traj.rewarded


def test_draws_in_flight_must_match_the_runs_dynamic_sampling():
    ckpt = NS(path=Path("step-000002"))
    for on, keeps in (("filter", False), ("off", True)):
        run = NS(producer=NS(ahead=[Produced(3, 1, _batch((0.0, 1.0)), (1, 1), 0.0,
                                             keeps_rewards=keeps)]), state=NS(ckpt=ckpt))
        with pytest.raises(RecipeError) as info:
            dynamic.refuse_held(run, NS(dynamic_sampling=on))
        assert info.value.problems[0].key == "algo.dynamic_sampling"
        assert info.value.problems[0].message == (
            f"the checkpoint step-000002 holds batches sampled ahead "
            f"{'without' if keeps is False else 'with'} dynamic sampling, which this run would "
            f"train {'with' if on == 'filter' else 'without'} it")
        dynamic.refuse_held(run, NS(dynamic_sampling="filter" if keeps else "off"))  # accepted


def test_the_dry_run_says_the_producers_draw_the_dynamic_batches():
    from runner.preview import pipeline_rows
    from runner.recipe import load_recipe
    from tests.conftest import REPO

    recipe = load_recipe(REPO / "recipes/grpo-dapo-arith.toml", ["algo.max_off_policy_steps=1"])
    (_, ahead), _ = pipeline_rows(recipe)
    assert "dynamic sampling draws each step's batches there" in ahead
    assert f"algo.max_sample_batches = {recipe.algo.max_sample_batches}" in ahead
    plain = load_recipe(REPO / "recipes/grpo-arith.toml", ["algo.max_off_policy_steps=1"])
    assert "dynamic sampling" not in pipeline_rows(plain)[0][1]
