"""Exact resume for PPO, OPD and DPO: stopped and killed runs end where the straight run ends.

One structure for the three algorithms (GRPO has its own file, test_resume_grpo.py): a straight
run of N steps, then in another folder K steps and a stop, SIGKILLs of the reruns at seeded
random points (some while a checkpoint is being written), and a last rerun to N. Every
metrics.jsonl value that is not a timing, the final weights and optimizer state (for PPO also
the critic and its optimizer) and the final state.json must equal the straight run's bitwise.
"""

from __future__ import annotations

import random

import attrs
import pytest

from tests.resume_helpers import (
    assert_same_run,
    final_weights,
    kill_at_random_points,
    run_cli,
)

pytestmark = pytest.mark.slow

N = 5  # steps of every run
K = 2  # where the stopped run stops
COMMON = ("data.validation.size=8", "train.eval_every=2", "checkpoint.every_steps=1",
          "checkpoint.keep_last=3", "logging.sample_every=0")
ROLLOUT = ("algo.prompts_per_step=4", "algo.samples_per_prompt=2", "rollout.max_new_tokens=4")
POLICY = ("model/model.safetensors", "optimizer.safetensors")
CRITIC = ("extra_models/critic/model.safetensors", "optimizer-critic.safetensors")


@attrs.frozen
class Case:
    recipe: str
    overrides: tuple[str, ...]
    files: tuple[str, ...]  # checkpoint files whose tensors must match bitwise
    seed: int  # of the kill points


CASES = {
    "ppo": Case("recipes/ppo-arith.toml", (*COMMON, *ROLLOUT, "algo.minibatches=2"),
                POLICY + CRITIC, seed=1),
    "opd": Case("recipes/opd-arith.toml", (*COMMON, *ROLLOUT), POLICY, seed=0),
    "dpo": Case("recipes/dpo-arith.toml",
                (*COMMON, "algo.pairs_per_step=4", "data.synthetic_pairs=200"),
                POLICY, seed=2),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def straight(request, tmp_path_factory):
    case = CASES[request.param]
    out = tmp_path_factory.mktemp(f"{request.param}-straight")
    done = run_cli(case.recipe, out, f"run.max_steps={N}", *case.overrides)
    assert done.returncode == 0, done.stdout + done.stderr
    return case, out


def test_stop_then_sigkills_then_resume(straight, tmp_path):
    """A run stops at step K; its reruns are SIGKILLed at seeded random points (some while a
    checkpoint is written); the last rerun ends bitwise like the straight run."""
    case, reference = straight
    first = run_cli(case.recipe, tmp_path, f"run.max_steps={K}", *case.overrides)
    assert first.returncode == 0, first.stdout + first.stderr
    where = kill_at_random_points(case.recipe, tmp_path, N, case.overrides,
                                  random.Random(case.seed), kills=2)
    done = run_cli(case.recipe, tmp_path, f"run.max_steps={N}", *case.overrides)
    assert done.returncode == 0, done.stdout + done.stderr
    assert where, "no kill happened"
    assert "resuming" in done.stdout
    try:
        assert_same_run(tmp_path, reference, N, case.files)
    except AssertionError as exc:
        raise AssertionError(f"after a stop at step {K} and kills at {where}: {exc}") from exc


def test_checkpoints_hold_what_is_compared(straight):
    """The comparisons above are not vacuous: each compared file holds tensors, and PPO's holds
    a critic that trained (its value head starts at zero) with an optimizer state for it."""
    case, reference = straight
    tensors = {name: final_weights(reference, N, name) for name in case.files}
    assert all(len(t) > 0 for t in tensors.values())
    assert {key.split(".", 1)[1] for key in tensors["optimizer.safetensors"]} == {
        "step", "exp_avg", "exp_avg_sq"}
    if case.files == POLICY + CRITIC:
        critic = tensors[CRITIC[0]]
        assert float(critic["v_head.weight"].abs().sum()) > 0
        assert float(critic["v_head.bias"].abs().sum()) > 0
        assert len(tensors[CRITIC[1]]) == len(critic) * 3  # step, exp_avg, exp_avg_sq each
