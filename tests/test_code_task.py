"""The built-in code task, the shipped ``tiny-code`` model and ``recipes/grpo-code.toml``: the
task's values and tests derived by hand, its programs scored by the real ``code_tests`` reward
(each in a child Python), the model's recorded held-out numbers reproduced, and a short run of
the recipe end to end."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from runner.data.code_task import CodeProblem, all_problems, held_out, problems, train
from runner.models.builtin import SHIPPED_ROOT
from runner.rewards.code_tests import fraction_passed
from runner.types import ObsBundle
from tests.multiproc import descendants, wait_gone
from tests.resume_helpers import assert_same_run, rows, run_cli, start_cli, wait_for_checkpoint


def test_a_problem_its_program_and_its_tests_by_hand():
    p = CodeProblem("times", 7, 2)
    assert p.question == "Write f(n): the sum of i * 7 for i from 2 to n."
    assert p.program() == "def f(n):\n    return sum(i * 7 for i in range(2, n + 1))"
    assert p.program(slip=True) == "def f(n):\n    return sum(i * 7 for i in range(2, n))"
    # 7 * (2 + 3 + 4) = 63, 7 * (2 + ... + 7) = 189, 7 * (2 + ... + 11) = 455
    assert p.tests == "assert f(4) == 63\nassert f(7) == 189\nassert f(11) == 455\n" \
                      "assert f(7) == 189"
    c = CodeProblem("count", 4, 3)  # i in 3..n divisible by 4
    assert c.question == "Write f(n): how many i from 3 to n are divisible by 4."
    assert [c.value(n) for n in c.test_inputs()] == [1, 1, 2, 2]  # n = 5, 7, 11, 8
    s = CodeProblem("square", 0, 1)
    assert [s.value(n) for n in (3, 7)] == [1 + 4 + 9, 140]


def test_the_splits_are_disjoint_and_deterministic():
    every = {p.key for p in all_problems()}
    train_keys = {p.key for p in problems("train", 5000)}
    held_keys = {p.key for p in problems("held_out", 5000)}
    assert train_keys | held_keys == every and not train_keys & held_keys
    assert len(held_keys) == 70 and len(every) == 392
    assert train(50)[7] == train(50)[7] and held_out(64).membership_ids()[:3] == \
        tuple(p.key for p in problems("held_out", 3))
    row = held_out(64)[0]
    assert set(row) == {"prompt", "tests", "key"} and row["tests"].count("assert f(") == 4


def test_code_tests_scores_the_right_and_the_one_short_programs():
    """Run for real: the right program passes every test; the one-short loop fails each test
    whose last term is not 0 (by hand: times 7 from 2 fails all four; count of multiples of 4
    from 3 fails only n = 8, the one test where n itself is a multiple)."""
    cases = [CodeProblem("times", 7, 2), CodeProblem("count", 4, 3), CodeProblem("plus", 1, 0)]
    items = [ObsBundle(p.question, p.tests) for p in cases]
    right = fraction_passed([p.program() for p in cases], items)
    short = fraction_passed([p.program(slip=True) for p in cases], items)
    assert right == [1.0, 1.0, 1.0]
    assert short == [0.0, 0.75, 0.0]


def test_the_shipped_model_reproduces_its_recorded_held_out_numbers():
    """The build's text shares are reproduced here, and running the greedy programs against
    their tests (the code_tests reward, all or nothing) passes exactly the right ones."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runner.models.tiny_code import HELD_OUT_EVAL, held_out_numbers, write_programs

    folder = SHIPPED_ROOT / "tiny-code"
    info = json.loads((folder / "build_info.json").read_text())
    greedy = info["held_out_greedy"]
    # the habit the recipe trains away: the greedy program is often exactly the one-short one
    assert 0.25 <= greedy["exact_right"] <= 0.55 and greedy["exact_one_short"] >= 0.4
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert held_out_numbers(model, tokenizer) == greedy
    items = problems("held_out", HELD_OUT_EVAL)
    texts = write_programs(model, tokenizer, items)
    passed = fraction_passed(texts, [ObsBundle(p.question, p.tests) for p in items],
                             all_or_nothing=True)
    assert passed == [float(t == p.program()) for t, p in zip(texts, items, strict=True)]


def test_the_code_recipe_runs_with_its_rewards_in_worker_processes(tmp_path):
    done = run_cli("recipes/grpo-code.toml", tmp_path, "run.max_steps=2", "train.eval_every=2",
                   "algo.prompts_per_step=4", "algo.group_size=4", "data.validation.size=8",
                   "reward.workers=2", "checkpoint.every_steps=2")
    assert done.returncode == 0, done.stdout + done.stderr
    got = rows(tmp_path)
    evals = [r for r in got if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2]
    # a passing program passes every test, so the share passing is at most the mean fraction
    assert all(r["eval/pass@1"] <= r["eval/reward/code_tests"] + 1e-12 for r in evals)
    steps = [r for r in got if "reward/failed/code_tests" in r]
    assert len(steps) == 2 and all(r["reward/failed/code_tests"] == 0 for r in steps)
    assert all(0.0 <= r["reward/code_tests"] <= 1.0 for r in steps)
    assert "held-out pass@1:" in done.stdout


def _programs_running(pids: set[int]) -> list[int]:
    """The processes of ``pids`` that are a code_tests child running a program."""
    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"def _watch(parent)" in cmdline:
            found.append(pid)
    return found


@pytest.mark.slow
def test_a_run_killed_while_its_programs_run_resumes_bitwise(tmp_path):
    """With the batch sampled ahead (the producer rewards it), the trainer is SIGKILLed while
    programs run in its reward workers: nothing it started is left, and the rerun ends bitwise
    like an uninterrupted run."""
    n = 4
    small = ("algo.prompts_per_step=4", "algo.group_size=4", "data.validation.size=4",
             "train.eval_every=2", "checkpoint.every_steps=1", "reward.workers=2",
             "algo.max_off_policy_steps=1", "data.items_fn=tests.extmods.slow_code.slow_first_test",
             f"run.max_steps={n}")
    straight = tmp_path / "straight"
    done = run_cli("recipes/grpo-code.toml", straight, *small)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "killed"
    proc = start_cli("recipes/grpo-code.toml", out, *small)
    wait_for_checkpoint(proc, out, 2)
    deadline = time.monotonic() + 120
    while not _programs_running(descendants(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.01)
    family = descendants(proc.pid) - {proc.pid}
    running = _programs_running(family)
    assert proc.poll() is None and running, "the run ended before a program ran after step 2"
    proc.kill()
    proc.communicate()
    assert wait_gone(sorted(family), timeout_s=10) == []
    done = run_cli("recipes/grpo-code.toml", out, *small)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming" in done.stdout
    assert_same_run(out, straight, n, ("model/model.safetensors", "optimizer.safetensors"))
