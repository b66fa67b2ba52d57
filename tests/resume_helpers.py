"""Helpers for the exact-resume tests: run the CLI in a subprocess, interrupt it, compare runs."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from runner.state.layout import TMP_PREFIX, checkpoint_step, complete_checkpoints, step_dirname
from tests import forkserver
from tests.conftest import REPO

CLI = [sys.executable, "-m", "runner.cli", "--plain"]


def run_cli(recipe: str, out: Path, *overrides: str,
            timeout: float = 600) -> subprocess.CompletedProcess:
    return forkserver.run([*CLI, recipe, f"run.output_dir={out}", *overrides], cwd=REPO,
                          env=_env(), timeout=timeout)


def _env() -> dict[str, str]:
    """The CLI's environment: one intra-op thread unless OMP_NUM_THREADS is set. The models are
    tiny; on a shared 2-core machine two spinning OpenMP threads made a 4-step PPO run take 38 s
    instead of 6 s. Runs compared with each other all use the same setting."""
    return {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # nothing may leave the machine


def start_cli(recipe: str, out: Path, *overrides: str) -> subprocess.Popen | forkserver.ForkedRun:
    return forkserver.popen([*CLI, recipe, f"run.output_dir={out}", *overrides], cwd=REPO,
                            env=_env())


class WaitTimedOut(AssertionError):
    """A wait gave up: the run neither got there nor ended. The test fails with what it saw."""


def _timed_out(proc: subprocess.Popen, what: str, timeout: float) -> WaitTimedOut:
    proc.kill()
    output = proc.communicate()[0] or ""
    return WaitTimedOut(f"waited {timeout:g} s for {what}; the run was still going (killed). "
                        f"Its output:\n{output[-4000:]}")


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    """Wait until metrics.jsonl, written since the wait began, has a row for ``step`` or the
    process ends; raise WaitTimedOut (after killing it) when neither happens within
    ``timeout`` seconds. A row that a killed earlier run left behind (after its last
    checkpoint) does not count: the new run rewrites the file from its checkpoint's rows when
    it starts, and a loaded machine may not have started it yet."""
    deadline, began = time.monotonic() + timeout, time.time()
    path = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        fresh = path.exists() and path.stat().st_mtime >= began
        if fresh and any(r["step"] >= step for r in rows(out)):
            return
        time.sleep(0.05)
    if proc.poll() is None:
        raise _timed_out(proc, f"metrics of step {step}", timeout)


def wait_for_checkpoint_write(proc: subprocess.Popen, out: Path, step: int,
                              timeout: float = 300) -> bool:
    """Wait until ``proc`` writes checkpoint ``step`` (its temporary folder exists); True if seen,
    False if it was written between two polls or the process ended. WaitTimedOut (after killing
    it) when none of these happens within ``timeout`` seconds.

    Polls every 2 ms: writing a tiny model's checkpoint takes tens of milliseconds. The folder
    name carries the writer's pid, so one left by an earlier killed run does not count.
    """
    root = out / "checkpoints"
    tmp = root / f"{TMP_PREFIX}{step_dirname(step)}-{proc.pid}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if tmp.exists():
            return True
        if (root / step_dirname(step)).is_dir():
            return False  # written and renamed between two polls
        time.sleep(0.002)
    if proc.poll() is None:
        raise _timed_out(proc, f"checkpoint {step} to be written", timeout)
    return False


def wait_for_checkpoint(proc: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    """Wait until a complete checkpoint of ``step`` or later exists or the process ends; raise
    WaitTimedOut (after killing it) when neither happens within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        done = complete_checkpoints(out / "checkpoints")
        if done and checkpoint_step(done[-1]) >= step:
            return
        time.sleep(0.02)
    if proc.poll() is None:
        raise _timed_out(proc, f"a complete checkpoint of step {step}", timeout)


def kill_at_random_points(recipe: str, out: Path, steps: int, overrides: tuple[str, ...],
                          rng: random.Random, kills: int) -> list[str]:
    """SIGKILL up to ``kills`` successive runs toward ``steps`` at points chosen by ``rng``.

    Each kill falls after the newest complete checkpoint: either during the checkpoint write of
    a chosen step (as soon as its temporary folder appears) or a random delay after a chosen
    step's checkpoint (anywhere: mid-step, mid-eval, mid-checkpoint). Needs
    ``checkpoint.every_steps=1``. Returns where each kill was aimed, for failure messages.
    """
    where: list[str] = []
    for _ in range(kills):
        done = complete_checkpoints(out / "checkpoints")
        first = checkpoint_step(done[-1]) + 1 if done else 1
        if first > steps - 1:
            break  # only the last step is left: nothing to kill before it
        mid_write = rng.random() < 0.5
        step = rng.randint(first, steps - 1)
        proc = start_cli(recipe, out, f"run.max_steps={steps}", *overrides)
        if mid_write:
            seen = wait_for_checkpoint_write(proc, out, step)
            where.append(f"checkpoint {step} ({'mid-write' if seen else 'missed'})")
        else:  # not metrics.jsonl: until the new run rewrites it, it holds the killed run's rows
            wait_for_checkpoint(proc, out, step)
            delay = rng.uniform(0.0, 0.5)
            time.sleep(delay)
            where.append(f"{delay:.2f} s after checkpoint {step}")
        alive = proc.poll() is None
        proc.kill()
        output = proc.communicate()[0]
        assert alive or proc.returncode == 0, output  # a run that died by itself is a failure
        if not alive:
            where[-1] += " (the run had finished)"
    return where


def interrupt(proc: subprocess.Popen, sig: int = signal.SIGINT) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=300)


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    result = []
    for line in lines:
        try:
            result.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return result


def deterministic_rows(out: Path) -> list[dict]:
    """metrics.jsonl rows without wall-clock keys."""
    from runner.ui.metrics import is_timing

    return [{k: v for k, v in r.items() if not is_timing(k)} for r in rows(out)]


def final_weights(out: Path, step: int, name: str = "model/model.safetensors"):
    return load_file(out / "checkpoints" / step_dirname(step) / name)


def _state(out: Path, step: int) -> dict:
    """state.json of checkpoint ``step`` without the RNG states (step, cursor, schedulers)."""
    state = json.loads((out / "checkpoints" / step_dirname(step) / "state.json").read_text())
    del state["rng"]
    return state


def assert_same_weights(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_same_run(out: Path, straight: Path, step: int,
                    files: tuple[str, ...] = ("model/model.safetensors",)) -> None:
    """Every non-timing metrics row, the tensors of ``files`` in checkpoint ``step`` (weights,
    optimizer state) and its state.json apart from the RNG equal the straight run's bitwise."""
    assert deterministic_rows(out) == deterministic_rows(straight)
    assert _state(out, step) == _state(straight, step)
    for name in files:
        assert_same_weights(final_weights(out, step, name), final_weights(straight, step, name))
