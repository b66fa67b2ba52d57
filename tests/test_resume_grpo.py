"""Exact resume for GRPO: stopped, interrupted and killed runs end where the straight run ends.

Every metrics.jsonl value that is not a timing, and the final weights, must be bitwise equal.
"""

from __future__ import annotations

import random
import signal

import pytest

from runner.state.layout import checkpoint_step, complete_checkpoints
from tests.resume_helpers import (
    assert_same_run,
    deterministic_rows,
    interrupt,
    kill_at_random_points,
    run_cli,
    start_cli,
    wait_for_step,
)

pytestmark = pytest.mark.slow

RECIPE = "recipes/grpo-arith.toml"
N = 6
SMALL = ("algo.prompts_per_step=4", "algo.group_size=4", "algo.minibatches=2",
         "rollout.max_new_tokens=4", "data.validation.size=8", "train.eval_every=2",
         "checkpoint.every_steps=1", "checkpoint.keep_last=3", "logging.sample_every=0")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    done = run_cli(RECIPE, out, f"run.max_steps={N}", *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _check_same(out, straight):
    assert_same_run(out, straight, N, ("model/model.safetensors", "optimizer.safetensors"))


def test_stop_refused_change_ctrl_c_then_resume(straight, tmp_path):
    """One run folder: a run stops at step 2; a rerun on changed data is refused with
    ``cursor_resume = "strict"``; the rerun is Ctrl-C'd at step 4 (exit 130, a checkpoint
    written); the next rerun ends bitwise like the straight run. Then, with
    ``cursor_resume = "off"``, the changed data is accepted and one more step trains."""
    first = run_cli(RECIPE, tmp_path, "run.max_steps=2", *SMALL)
    assert first.returncode == 0, first.stderr
    changed = run_cli(RECIPE, tmp_path, f"run.max_steps={N}", *SMALL, "data.count=1500",
                      "data.cursor_resume=strict")
    assert changed.returncode == 2
    assert "data.cursor_resume" in changed.stderr and "2000 -> 1500" in changed.stderr
    proc = start_cli(RECIPE, tmp_path, f"run.max_steps={N}", *SMALL, "checkpoint.every_steps=100")
    wait_for_step(proc, tmp_path, 4)
    assert interrupt(proc, signal.SIGINT) == 130
    newest = checkpoint_step(complete_checkpoints(tmp_path / "checkpoints")[-1])
    assert newest >= 4, f"no checkpoint written on Ctrl-C (newest: step {newest})"
    done = run_cli(RECIPE, tmp_path, f"run.max_steps={N}", *SMALL)
    assert done.returncode == 0, done.stderr
    assert f"(step {newest})" in done.stdout and "resuming" in done.stdout
    _check_same(tmp_path, straight)
    off = run_cli(RECIPE, tmp_path, f"run.max_steps={N + 1}", *SMALL, "data.count=1500",
                  "data.cursor_resume=off")
    assert off.returncode == 0, off.stderr
    assert [r["step"] for r in deterministic_rows(tmp_path) if "loss" in r][-1] == N + 1


def test_sigkill_at_random_points_then_resume(straight, tmp_path):
    where = kill_at_random_points(RECIPE, tmp_path, N, SMALL, random.Random(1234), kills=3)
    done = run_cli(RECIPE, tmp_path, f"run.max_steps={N}", *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert where, "no kill happened"
    try:
        _check_same(tmp_path, straight)
    except AssertionError as exc:
        raise AssertionError(f"after kills at {where}: {exc}") from exc
