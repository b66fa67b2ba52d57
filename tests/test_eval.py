"""``posttrain-run eval``: the recipe's held-out set, several completions per prompt, pass@k
(Chen et al.'s unbiased estimator, checked against the binomial formula) and majority voting;
every number of eval.json recomputed here from its completions; a checkpoint's own weights; the
same results on two torchrun ranks; one-line refusals with exit 2."""

from __future__ import annotations

import json
import re
from collections import Counter
from itertools import product
from math import comb

import pytest

from runner.rewards.passk import majority_passes, pass_at_k
from tests.conftest import REPO
from tests.resume_helpers import CLI, _env, run_cli

GRPO = "recipes/grpo-arith.toml"
SMALL = ("algo.prompts_per_step=4", "algo.group_size=4", "rollout.max_new_tokens=4",
         "data.validation.size=12", "train.eval_every=2", "checkpoint.every_steps=2",
         "logging.sample_every=0", "run.max_steps=2")
SAMPLED = ("eval.num_samples=4", "eval.temperature=1.0")


def _eval(*args: str):
    from tests import forkserver

    return forkserver.run([*CLI[:3], "eval", "--plain", *map(str, args)], cwd=REPO, env=_env(),
                          timeout=300)


def _result(folder) -> dict:
    return json.loads((folder / "eval.json").read_text())


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 2, 2, 5 / 6), (4, 0, 3, 0.0), (4, 4, 1, 1.0),
    (8, 1, 8, 1.0), (8, 3, 6, 1.0)])
def test_pass_at_k_by_hand(n, c, k, expected):
    # e.g. n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_equals_the_binomial_formula():
    for n, k in product(range(1, 21), range(1, 21)):
        for c in range(n + 1) if k <= n else ():
            exact = 1 - comb(n - c, k) / comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_vote_takes_the_most_given_answer_first_on_ties():
    answer = lambda t: t.split()[-1] if t.split() else None  # noqa: E731
    assert majority_passes(["a 1", "b 2", "c 2"], [True, False, False], answer) is False
    assert majority_passes(["a 1", "b 2", "c 1"], [True, False, True], answer) is True
    assert majority_passes(["x 2", "y 1"], [False, True], answer) is False  # tie: first given
    assert majority_passes(["", " ", "z 3"], [False, False, True], answer) is True  # no answer
    assert majority_passes(["", ""], [False, False], answer) is False


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("evalrun")
    done = run_cli(GRPO, out, *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _last_integer(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def test_eval_of_the_latest_checkpoint_recomputed_from_its_completions(run_dir):
    done = _eval(GRPO, f"run.output_dir={run_dir}", "--checkpoint", "latest", *SMALL, *SAMPLED,
                 "--save-completions")
    assert done.returncode == 0, done.stdout + done.stderr
    folder = run_dir / "eval" / "step-000002"
    result = _result(folder)
    assert result["checkpoint"] == str((run_dir / "checkpoints" / "step-000002").resolve())
    assert (result["step"], result["prompts"], result["num_samples"]) == (2, 12, 4)
    assert result["pass_reward"] == "arithmetic_exact" and result["pass_at"] == [1, 4]
    items = result["items"]
    assert [it["index"] for it in items] == list(range(12))
    pass1, pass4, maj, rewards = [], [], [], []
    for it in items:
        texts = it["completions"]
        assert len(texts) == 4
        right = [_last_integer(t) == int(it["reference"]) for t in texts]
        assert it["rewards"] == [float(r) for r in right] == it["reward_of"]["arithmetic_exact"]
        assert it["passed"] == right
        c = sum(right)
        pass1.append(c / 4)
        pass4.append(1 - comb(4 - c, 4) / comb(4, 4))
        votes = Counter(a for a in map(_last_integer, texts) if a is not None)
        top = [a for a in map(_last_integer, texts) if a is not None and votes[a] == max(
            votes.values())][:1]
        maj.append(float(bool(top) and top[0] == int(it["reference"])))
        assert it["scores"] == pytest.approx({"pass@1": pass1[-1], "pass@4": pass4[-1],
                                              "maj@4": maj[-1]}, abs=1e-12)
        rewards += it["rewards"]
    m = result["metrics"]
    assert m["reward"] == pytest.approx(sum(rewards) / 48, abs=1e-12)
    assert m["pass@1"] == pytest.approx(sum(pass1) / 12, abs=1e-12)
    assert m["pass@4"] == pytest.approx(sum(pass4) / 12, abs=1e-12)
    assert m["maj@4"] == pytest.approx(sum(maj) / 12, abs=1e-12)
    assert m["pass@1"] <= m["pass@4"]
    assert f"pass@4: {m['pass@4']:.4f}" in done.stdout  # the table
    # The same checkpoint named by its folder, and its model folder given as model.path: the
    # same completions (the checkpoint's own weights are what was evaluated).
    by_path = run_dir / "by-path"
    done = _eval(GRPO, f"run.output_dir={run_dir}", "--checkpoint",
                 run_dir / "checkpoints" / "step-000002", "--out", by_path, *SMALL, *SAMPLED,
                 "--save-completions")
    assert done.returncode == 0, done.stdout + done.stderr
    as_model = run_dir / "as-model"
    done = _eval(GRPO, f"run.output_dir={run_dir}", "--out", as_model, *SMALL, *SAMPLED,
                 f"model.path={run_dir / 'checkpoints' / 'step-000002' / 'model'}",
                 "--save-completions")
    assert done.returncode == 0, done.stdout + done.stderr
    texts = [it["completions"] for it in items]
    assert [it["completions"] for it in _result(by_path)["items"]] == texts
    assert [it["completions"] for it in _result(as_model)["items"]] == texts


def test_two_torchrun_ranks_evaluate_the_same_prompts_alike(run_dir):
    one, two = run_dir / "one-rank", run_dir / "two-ranks"
    common = (GRPO, f"run.output_dir={run_dir}", "--checkpoint", "latest", *SMALL, *SAMPLED,
              "--save-completions")
    done = _eval(*common, "--out", one)
    assert done.returncode == 0, done.stdout + done.stderr
    done = _eval(*common, "--out", two, "launch.backend=torchrun", "launch.num_processes=2")
    assert done.returncode == 0, done.stdout + done.stderr
    a, b = _result(one), _result(two)
    assert [it["index"] for it in b["items"]] == list(range(12))
    assert [it["completions"] for it in b["items"]] == [it["completions"] for it in a["items"]]
    assert b["metrics"] == pytest.approx(a["metrics"], abs=1e-12)


def test_training_logs_pass_at_k_with_several_held_out_samples(tmp_path):
    done = run_cli(GRPO, tmp_path, *SMALL, *SAMPLED, "eval.pass_at=[2, 4]")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 2]
    first, last = evals
    assert (f"held-out pass@4: {first['eval/pass@4']:.3f} (step 0) -> "
            f"{last['eval/pass@4']:.3f} (step 2)") in done.stdout  # the summary
    for row in evals:
        assert {"eval/pass@2", "eval/pass@4", "eval/maj@4"} <= row.keys()
        assert "eval/pass@1" not in row
        # a 0/1 reward: pass@2 lies between the mean reward (pass@1) and pass@4
        assert row["eval/reward"] - 1e-12 <= row["eval/pass@2"] <= row["eval/pass@4"] + 1e-12


def test_eval_refusals_are_one_line_with_exit_2(run_dir, tmp_path):
    cases = [
        (("--checkpoint", "latest", f"run.output_dir={tmp_path}"),
         f"eval: {tmp_path} has no complete checkpoint"),
        (("--checkpoint", tmp_path / "nowhere" / "step-000009"),
         f"eval: {tmp_path / 'nowhere' / 'step-000009'} is not a checkpoint folder"),
        (("--checkpoint", run_dir / "checkpoints" / "step-000001"),
         f"eval: {run_dir} has no complete checkpoint of step 1"),
        (("data.validation.enabled=false",), "the recipe has no held-out set to evaluate on"),
        (("eval.pass_at=[5]", *SAMPLED), "eval.pass_at[0]"),
        (("model.path=/nonexistent/model",), "model.path"),
    ]
    for args, expected in cases:
        done = _eval(GRPO, *SMALL, *args)
        assert done.returncode == 2, (args, done.stdout + done.stderr)
        assert expected in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr


def test_an_evaluation_plans_no_frozen_role():
    """Ray starts no reference or teacher actor for an evaluation (its plan lists none)."""
    from runner.eval.job import eval_plan
    from runner.launch.ray_roles import frozen_roles
    from runner.recipe import load_recipe, make_plan

    for name in ("ppo-arith", "opd-arith"):
        plan = make_plan(load_recipe(REPO / "recipes" / f"{name}.toml", []), world_size=2)
        assert frozen_roles(plan.roles) and not frozen_roles(eval_plan(plan).roles)
        assert {"rollout", "reward"} <= set(eval_plan(plan).roles)


def test_the_eval_job_crosses_to_the_ranks_as_plain_data(tmp_path):
    """The driver's EvalJob travels in the ranks' payload file as plain JSON (the checkpoint
    "" for model.path) and comes back equal; a payload without a job trains."""
    import pickle
    from pathlib import Path

    from runner.errors import RunnerError
    from runner.eval.job import EvalJob
    from runner.launch.payload import Payload
    from runner.recipe import load_recipe

    recipe = load_recipe(REPO / GRPO, [])
    ckpt = EvalJob(checkpoint=Path("/runs/a/checkpoints/step-000002"), step=2,
                   label="step-000002", out_dir=Path("/runs/a/eval/step-000002"),
                   save_completions=True)
    model = EvalJob(checkpoint=None, step=None, label="model-tiny", out_dir=Path("/out"))
    assert model.to_dict() == {"command": "eval", "checkpoint": "", "step": None,
                               "label": "model-tiny", "out_dir": "/out",
                               "save_completions": False}
    for job in (ckpt, model, None):
        payload = Payload.of(recipe, source=GRPO, overrides=("run.seed=1",), cwd=".",
                             plain=True, job=job)
        path = tmp_path / "payload.json"
        payload.write(path)
        raw = json.loads(path.read_text())
        assert raw["job"] == (job.to_dict() if job else {})
        assert Payload.read(path) == payload == pickle.loads(pickle.dumps(payload))
    with pytest.raises(RunnerError, match="unknown job 'export'"):
        EvalJob.from_dict({**model.to_dict(), "command": "export"})
