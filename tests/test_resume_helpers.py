"""The resume tests' waits fail when they time out; they never return as if the run got there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import resume_helpers as rh


@pytest.fixture
def sleeper():
    """A process that neither writes metrics nor checkpoints nor ends (until killed)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('working', flush=True); "
                             "time.sleep(600)"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("wait, what", [
    (rh.wait_for_step, "metrics of step 3"),
    (rh.wait_for_checkpoint, "a complete checkpoint of step 3"),
    (rh.wait_for_checkpoint_write, "checkpoint 3 to be written"),
])
def test_a_wait_that_times_out_fails_and_kills_the_run(tmp_path, sleeper, wait, what):
    with pytest.raises(rh.WaitTimedOut) as info:
        wait(sleeper, tmp_path, 3, timeout=0.3)
    assert str(info.value).startswith(f"waited 0.3 s for {what}; the run was still going")
    assert sleeper.poll() is not None  # killed, not left running


def test_a_run_that_ends_first_is_not_a_timeout(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, text=True)
    proc.wait()
    assert rh.wait_for_step(proc, tmp_path, 3, timeout=0.3) is None
    assert rh.wait_for_checkpoint_write(proc, tmp_path, 3, timeout=0.3) is False
    proc.communicate()
