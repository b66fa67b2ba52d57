"""End to end: a run resumes past a damaged newest checkpoint, exactly, and storage failures end
a run with one line and exit 1."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.resume_helpers import assert_same_run, run_cli

pytestmark = pytest.mark.slow

RECIPE = "recipes/grpo-arith.toml"
N = 3
SMALL = ("algo.prompts_per_step=2", "algo.group_size=2", "algo.minibatches=1",
         "rollout.max_new_tokens=3", "data.validation.size=4", "train.eval_every=0",
         "checkpoint.every_steps=1", "checkpoint.keep_last=3", "logging.sample_every=0")


def test_truncated_model_in_the_newest_checkpoint_falls_back(tmp_path):
    straight = tmp_path / "straight"
    done = run_cli(RECIPE, straight, f"run.max_steps={N}", *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "damaged"
    first = run_cli(RECIPE, out, "run.max_steps=2", *SMALL)
    assert first.returncode == 0, first.stdout + first.stderr
    weights = out / "checkpoints" / "step-000002" / "model" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    second = run_cli(RECIPE, out, f"run.max_steps={N}", *SMALL)
    assert second.returncode == 0, second.stdout + second.stderr
    assert (f"skipping checkpoint {out / 'checkpoints' / 'step-000002'}: model/model.safetensors "
            f"has {size // 2} bytes where the manifest records {size}") in second.stdout
    assert f"from {out / 'checkpoints' / 'step-000001'} (step 1)" in second.stdout
    assert "Traceback" not in second.stderr
    assert_same_run(out, straight, N, ("model/model.safetensors", "optimizer.safetensors"))


def test_unwritable_output_folder_is_one_line():
    # A short folder: the message shortens a long value, and a worker's tmp_path can be long.
    short = Path(tempfile.mkdtemp(prefix="ptr-"))
    blocker = short / "file"
    blocker.write_text("not a folder")
    done = run_cli(RECIPE, blocker / "run", "run.max_steps=1", *SMALL)
    assert done.returncode == 2, done.stdout + done.stderr  # refused at validation
    lines = done.stderr.strip().splitlines()
    shutil.rmtree(short)
    assert lines == [f"recipes/grpo-arith.toml: run.output_dir: cannot be made: {blocker} is not a "
                     f"folder (got '{blocker / 'run'}'). Choose a folder path for the run's "
                     "outputs."]
