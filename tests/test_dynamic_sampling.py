"""DAPO's dynamic sampling (``algo.dynamic_sampling = "filter"``): the items a step consumes and
trains on against a hand-built list for a reward pattern fixed by the data alone, the cap (some
groups kept: they train as a batch of that many; none kept: no update), the recipe's refusals,
the dry run's plan, 1 rank against 2, and a SIGKILLed run resumed bitwise.

The reward functions (``tests/extmods/patterned.py``) give a group all-equal rewards exactly
when its item's answer matches a rule, whatever the model samples, so the expected lists follow
from the data order (``epoch_order``) and the rule, by the rule of the module docstring of
``runner/train/loops/dynamic.py`` written out here once more.
"""

from __future__ import annotations

import random

import pytest
import torch

from runner.data.order import epoch_order
from runner.errors import RecipeError
from runner.recipe import make_plan, recipe_from_mapping
from runner.train.loops import dynamic, grpo
from runner.train.loops.trajectory import Trajectory
from tests.multiproc import run_ranks
from tests.resume_helpers import (
    assert_same_run,
    deterministic_rows,
    final_weights,
    kill_at_random_points,
    run_cli,
)
from tests.tiny_run import tiny_run

GRPO = "recipes/grpo-arith.toml"
P = 4  # prompts_per_step
DYN = ("algo.dynamic_sampling=filter", f"algo.prompts_per_step={P}", "algo.group_size=2",
       "algo.minibatches=2", "rollout.max_new_tokens=4", "logging.item_ids=true")


def _reward(name: str) -> str:
    return f'reward.functions=["tests.extmods.patterned.{name}"]'


def _ties(name: str):
    return {"ties_on_multiples_of_3": lambda a: a % 3 == 0,
            "ties_unless_multiple_of_4": lambda a: a % 4 != 0,
            "always_ties": lambda a: True}[name]


def expected(source, seed: int, rule: str, cap: int, steps: int
             ) -> list[tuple[list[int], list[int], int]]:
    """Per step, by hand: (items consumed in order, items trained on, batches drawn). Batches
    of P items are taken from the data order while fewer than P of the step's items are kept
    and fewer than ``cap`` batches were drawn; the first P kept ones train."""
    order = epoch_order(len(source), seed, 0, source.shuffle).tolist()
    tie, pos, out = _ties(rule), 0, []
    for _ in range(steps):
        consumed: list[int] = []
        while len(consumed) < cap * P and sum(
                not tie(int(source.item(i).reference)) for i in consumed) < P:
            consumed += order[pos:pos + P]
            pos += P
        kept = [i for i in consumed if not tie(int(source.item(i).reference))][:P]
        out.append((consumed, kept, len(consumed) // P))
    return out


def _weights(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.policy.model.state_dict().items()}


def test_items_consumed_in_order_equal_the_hand_built_list(tmp_path):
    """Groups of answers divisible by 3 are dropped: each step draws a second batch, whose
    surplus of kept groups is dropped (its items consumed all the same)."""
    rule = "ties_on_multiples_of_3"
    with tiny_run("grpo-arith", tmp_path, *DYN, _reward(rule)) as run:
        algo, rewards = run.svc.recipe.algo, run.roles.rewards
        want = expected(run.state.data.source, run.svc.recipe.run.seed, rule, 3, 3)
        rows = [grpo.one_step(run, algo, rewards, step) for step in (1, 2, 3)]
    assert [r["data/items_consumed"] for r in rows] == [c for c, _, _ in want]
    assert [r["data/item_ids"] for r in rows] == [k for _, k, _ in want]
    assert [r["sampling/extra_batches"] for r in rows] == [float(n - 1) for _, _, n in want]
    assert [r["sampling/items_consumed"] for r in rows] == [float(len(c)) for c, _, _ in want]
    assert [r["sampling/kept_groups"] for r in rows] == [float(P)] * 3
    src = run.state.data.source
    assert [r["sampling/filtered_frac"] for r in rows] == [
        sum(int(src.item(i).reference) % 3 == 0 for i in c) / len(c) for c, _, _ in want]
    assert any(n > 1 for _, _, n in want) and all("grad_norm" in r for r in rows)


def test_at_the_cap_the_kept_groups_train_as_a_batch_of_that_many(tmp_path, monkeypatch):
    """Only answers divisible by 4 give differing rewards; two batches keep 3 groups. The
    update equals a plain step's (``dynamic_sampling = "off"``, ``prompts_per_step = 3``) on
    those 3 groups, bitwise: the loss is normalised over the kept groups only."""
    rule = "ties_unless_multiple_of_4"
    with tiny_run("grpo-arith", tmp_path / "a", *DYN, _reward(rule),
                  "algo.max_sample_batches=2") as run:
        algo, rewards = run.svc.recipe.algo, run.roles.rewards
        (consumed, kept, batches), = expected(run.state.data.source, run.svc.recipe.run.seed,
                                             rule, 2, 1)
        seen = []

        def draw(*args):
            seen.append(real(*args))
            return seen[-1]

        real = dynamic.draw
        monkeypatch.setattr(dynamic, "draw", draw)
        filtered = grpo.one_step(run, algo, rewards, 1)
        after_filtered = _weights(run)
    (drawn,) = seen
    assert (drawn.kept, batches, len(kept), filtered["sampling/kept_groups"]) == (3, 2, 3, 3.0)
    assert filtered["data/items_consumed"] == consumed and filtered["data/item_ids"] == kept
    plain = ("algo.prompts_per_step=3", "algo.group_size=2", "algo.minibatches=2",
             "rollout.max_new_tokens=4", _reward(rule))
    with tiny_run("grpo-arith", tmp_path / "b", *plain) as run:
        unrewarded = Trajectory(drawn.traj.items, drawn.traj.prompt_ids,
                                drawn.traj.completions)
        reference = grpo.consume(run, run.svc.recipe.algo, grpo.score(
            run, run.svc.recipe.algo, run.roles.rewards, unrewarded, 1))
        after_plain = _weights(run)
    assert filtered["loss"] == reference["loss"] and filtered["grad_norm"] == reference["grad_norm"]
    assert all(torch.equal(after_filtered[k], after_plain[k]) for k in after_plain)


def test_a_step_that_keeps_no_group_does_not_update(tmp_path):
    with tiny_run("grpo-arith", tmp_path, *DYN, _reward("always_ties"),
                  "algo.max_sample_batches=2") as run:
        algo, rewards = run.svc.recipe.algo, run.roles.rewards
        before = _weights(run)
        row = grpo.one_step(run, algo, rewards, 1)
        after = _weights(run)
    assert row["sampling/kept_groups"] == 0.0 and row["sampling/extra_batches"] == 1.0
    assert row["sampling/items_consumed"] == 2.0 * P and row["sampling/filtered_frac"] == 1.0
    assert row["data/item_ids"] == [] and "grad_norm" not in row
    assert all(torch.equal(before[k], after[k]) for k in before)


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe_from_mapping({}, source="r.toml", overrides=overrides)
    return info.value.lines()


CL = "command line: "


def test_recipe_refusals_are_named_and_reported_together():
    assert _problems("algo.dynamic_sampling=filter", "algo.advantage=reinforce_pp",
                     "algo.group_size=1", "algo.max_sample_batches=0",
                     "algo.max_off_policy_steps=1") == [
        CL + "algo.max_sample_batches: must be >= 1 (the first batch of the step counts) "
        "(got 0).",
        CL + "algo.dynamic_sampling: drops the groups whose rewards are all equal, and a group "
        "of 1 completion always is (got 'filter'). Raise algo.group_size to at least 2, or set "
        "algo.dynamic_sampling = 'off'.",
        CL + "algo.dynamic_sampling: drops groups with no advantage signal within the group, "
        "but advantage = 'reinforce_pp' normalises over the batch, not the group (got "
        "'filter'). Use a group estimator (algo.advantage = 'grpo', 'rloo' or "
        "'reinforce_pp_baseline'), or set algo.dynamic_sampling = 'off'."]  # (k = 1 is fine)
    assert _problems("algo.max_sample_batches=2") == [
        CL + "algo.max_sample_batches: is read only with dynamic_sampling = 'filter', but "
        "dynamic_sampling is 'off' (got 2). Remove it, or set algo.dynamic_sampling = "
        "'filter'."]
    assert _problems("algo.dynamic_sampling=on") == [
        CL + "algo.dynamic_sampling: not a valid choice (got 'on'). Choose one of 'off', "
        "'filter'."]
    recipe_from_mapping({}, source="r.toml", overrides=(
        "algo.dynamic_sampling=filter", "algo.advantage=rloo", "algo.max_sample_batches=1"))


# Float64 and padded batches, as tests/test_torchrun.py compares layouts: 1 rank and 2 agree to
# rounding; the cap keeps 3, 1, 1 groups (a rank holds none: it pads).
F64 = ("model.dtype=float64", "train.padding_free=false", "data.validation.size=8",
       "train.eval_every=3", "logging.sample_every=0", "train.grad_accum_steps=2",
       "launch.collective_timeout_s=60", "checkpoint.every_steps=1",
       "checkpoint.keep_last=3")


@pytest.mark.slow
@pytest.mark.multiproc
def test_one_rank_and_two_ranks_draw_and_train_the_same(tmp_path):
    rule = "ties_unless_multiple_of_4"
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        done = run_ranks(GRPO, out, world, "run.max_steps=3", *DYN, *F64, _reward(rule),
                         "algo.max_sample_batches=2")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "step 2: dynamic sampling kept 1 of 4 groups in 2 batch(es)" in done.stdout
        runs[world] = out
    one, two = (deterministic_rows(runs[w]) for w in (1, 2))
    keys = ("data/items_consumed", "data/item_ids", "sampling/kept_groups",
            "sampling/filtered_frac", "sampling/extra_batches", "reward/mean")
    assert [[r.get(k) for k in keys] for r in one] == [[r.get(k) for k in keys] for r in two]
    assert [r["sampling/kept_groups"] for r in one if "loss" in r] == [3.0, 1.0, 1.0]
    a, b = final_weights(runs[1], 3), final_weights(runs[2], 3)
    worst = max(float((b[k] - a[k]).norm() / a[k].norm()) for k in a if a[k].norm() > 0)
    assert worst < 1e-10, worst
    start = final_weights(runs[1], 1)
    assert any(not torch.equal(start[k], a[k]) for k in a)


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_bitwise(tmp_path):
    n = 4
    small = (*DYN, _reward("ties_on_multiples_of_3"), "data.validation.size=8",
             "train.eval_every=2", "checkpoint.every_steps=1", "checkpoint.keep_last=3",
             "logging.sample_every=0")
    straight = tmp_path / "straight"
    done = run_cli(GRPO, straight, f"run.max_steps={n}", *small)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "killed"
    where = kill_at_random_points(GRPO, out, n, small, random.Random(38), kills=2)
    done = run_cli(GRPO, out, f"run.max_steps={n}", *small)
    assert done.returncode == 0, done.stdout + done.stderr
    assert where, "no kill happened"
    try:
        assert_same_run(out, straight, n, ("model/model.safetensors", "optimizer.safetensors"))
    except AssertionError as exc:
        raise AssertionError(f"after kills at {where}: {exc}") from exc
    assert all(r["sampling/extra_batches"] == 1.0 for r in deterministic_rows(out) if "loss" in r)


def test_the_plan_shows_the_most_items_a_step_may_draw():
    rows = dict(make_plan(recipe_from_mapping({}, source="r.toml", overrides=(
        *DYN, "algo.max_sample_batches=3"))).rows())
    assert rows["items per step"] == ("4 (up to 12: groups with all-equal rewards are dropped "
                                      "and more drawn)")
    assert dict(make_plan(recipe_from_mapping({}, source="r.toml")).rows())[
        "items per step"] == "8"
