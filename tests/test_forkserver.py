"""The test suite's forked CLI runs (``tests/forkserver.py``) behave as started ones do: the
same training to the bit, the same output and exit codes, a pid that signals reach."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests import forkserver
from tests.conftest import REPO
from tests.resume_helpers import CLI, _env, assert_same_run, wait_for_step

RECIPE = "recipes/grpo-arith.toml"
SMALL = ("run.max_steps=2", "algo.prompts_per_step=4", "algo.group_size=4",
         "rollout.max_new_tokens=4", "data.validation.size=8", "train.eval_every=1",
         "checkpoint.every_steps=1")


def _started(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def server():
    """A server of this module's own: every run below is forked, whatever other tests ran in
    this worker before."""
    own = forkserver.Server(_env(), REPO)
    yield own
    own.close()


def _forked(server: forkserver.Server, *args: str) -> subprocess.CompletedProcess:
    return forkserver.run([*CLI, *args], cwd=REPO, env=_env(), timeout=300, server=server)


def test_a_forked_run_trains_and_says_what_a_started_run_does(server, tmp_path):
    started = _started(RECIPE, f"run.output_dir={tmp_path / 'started'}", *SMALL)
    forked = _forked(server, RECIPE, f"run.output_dir={tmp_path / 'forked'}", *SMALL)
    assert started.returncode == forked.returncode == 0, started.stderr + forked.stderr
    assert_same_run(tmp_path / "forked", tmp_path / "started", 2,
                    ("model/model.safetensors", "optimizer.safetensors"))

    def shape(text: str) -> list[str]:  # the lines, less wall-clock figures and the folder
        return [line.split("=")[0].split(":")[0] for line in text.splitlines()]

    assert shape(forked.stdout) == shape(started.stdout)
    assert forked.stderr == started.stderr


def test_a_forked_run_exits_and_dies_like_a_started_one(server, tmp_path):
    bad = ("algo.group_size=0",)
    started, forked = _started(RECIPE, *bad), _forked(server, RECIPE, *bad)
    assert started.returncode == forked.returncode == 2
    assert forked.stderr == started.stderr and "algo.group_size: must be >= 2" in forked.stderr
    proc = forkserver.popen([*CLI, RECIPE, f"run.output_dir={tmp_path}", "run.max_steps=500"],
                            cwd=REPO, env=_env(), start_new_session=True, server=server)
    assert isinstance(proc, forkserver.ForkedRun)
    assert os.getsid(proc.pid) == proc.pid  # a session of its own, as asked
    wait_for_step(proc, tmp_path, 1)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.communicate(timeout=60)
