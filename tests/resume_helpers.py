"""Helpers for the exact-resume tests: run the CLI in a subprocess, interrupt it, compare runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from tests.conftest import REPO

CLI = [sys.executable, "-m", "runner.cli", "--plain"]


def run_cli(recipe: str, out: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, recipe, f"run.output_dir={out}", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=_env())


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def start_cli(recipe: str, out: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, recipe, f"run.output_dir={out}", *overrides], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    """Wait until metrics.jsonl has a row for ``step`` (or the process ends)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(r["step"] >= step for r in rows(out)):
            return
        time.sleep(0.05)


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
    return load_file(out / "checkpoints" / f"step-{step:06d}" / name)


def assert_same_weights(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
