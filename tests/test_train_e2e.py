"""Every algorithm runs end to end from the CLI on the tiny built-in model (a few steps), and the
GRPO loop also runs with the vllm engine (its episodes played by an openai-SDK agent).
Learning itself is measured by the recipes (README)."""

from __future__ import annotations

import json
import math

import pytest

from tests.resume_helpers import run_cli

pytestmark = pytest.mark.slow

FAST = ("run.max_steps=2", "data.validation.size=8", "train.eval_every=1", "logging.sample_every=1")


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe,extra,keys", [
    ("recipes/ppo-arith.toml", ("algo.prompts_per_step=4", "rollout.max_new_tokens=4"),
     ("value_loss", "kl", "reward/mean")),
    ("recipes/opd-arith.toml", ("algo.prompts_per_step=4", "rollout.max_new_tokens=4",
                                "algo.teacher_path=builtin:tiny-arith"), ("reverse_kl",)),
    ("recipes/opd-cross-tokenizer.toml", ("algo.prompts_per_step=4", "rollout.max_new_tokens=4"),
     ("reverse_kl",)),
    ("recipes/dpo-arith.toml", ("algo.pairs_per_step=4",), ("reward_margin", "accuracy")),
])
def test_algorithm_runs_and_logs_its_metrics(tmp_path, recipe, extra, keys):
    done = run_cli(recipe, tmp_path, *FAST, *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in keys:
        assert key in rows[1], (key, rows[1])
        assert math.isfinite(rows[1][key]), (key, rows[1])
    assert (tmp_path / "checkpoints" / "step-000002" / "COMPLETE").is_file()
    assert (tmp_path / "recipe.resolved.toml").is_file()
    assert "held-out" in done.stdout and "checkpoint" in done.stdout


def test_opd_with_itself_as_teacher_has_zero_reverse_kl(tmp_path):
    done = run_cli("recipes/opd-arith.toml", tmp_path, *FAST, "algo.prompts_per_step=4",
                   "rollout.max_new_tokens=4", "algo.teacher_path=builtin:tiny-arith")
    assert done.returncode == 0, done.stderr
    assert _rows(tmp_path)[1]["reverse_kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.vllm
def test_grpo_with_vllm_engine_trains_an_openai_sdk_agent(tmp_path):
    """GRPO with the vllm engine, its episodes played by the openai-SDK agent of
    ``examples/openai_agent.py`` against the runner's endpoint (training and held-out): the
    tokens trained are the ones vllm sampled (the policy's logprobs of them within 1e-3 of
    vllm's; re-tokenised text would differ by whole nats), with tool calls made."""
    pytest.importorskip("vllm")
    done = run_cli("recipes/grpo-openai-agent.toml", tmp_path, *FAST, "rollout.engine=vllm",
                   "algo.prompts_per_step=4", "algo.group_size=4")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(tmp_path)
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 2 and all(r["env/turns"] >= 1.0 for r in trained)
    assert sum(r["env/tool_calls"] for r in trained) > 0, trained
    assert max(r["rollout/logprob_gap"] for r in trained) < 1e-3, trained
    held_out = rows[-1]  # the agents played the held-out episodes too, without an error
    assert held_out["eval/env/turns"] >= 1.0 and held_out["eval/env/agent_error"] == 0.0
