"""Rewards that run code: the ``code_tests`` rewards on hand-written programs, and process
isolation (``reward.isolation = "process"``) containing every way a sample can misbehave, each
as a real child process; nothing outlives the trainer, even SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from runner.errors import RewardFailure
from runner.recipe import load_recipe
from runner.recipe.schema import RewardConfig
from runner.rewards import build_rewards
from runner.rewards.code_tests import code_tests, code_tests_all, fraction_passed, program_of
from runner.rewards.sandbox import Limits
from runner.types import ObsBundle
from tests.conftest import REPO
from tests.multiproc import descendants, wait_gone
from tests.resume_helpers import deterministic_rows, final_weights, run_cli

ASSERTS = "assert f(1) == 2\nassert f(2) == 4\nassert f(3) == 7\n"  # 7: f = 2x fails the third
PROGRAMS = {  # program -> tests passed of the three
    "```python\ndef f(x):\n    return 2 * x\n```": 2,
    "Here it is:\n```\ndef f(x):\n    return 7 if x == 3 else 2 * x\n```\ndone": 3,
    "def f(x) return": 0,  # a syntax error
    "def f(x):\n    return 0": 0,
    "import sys\ndef f(x):\n    return 2 * x\nsys.exit(0)": 0,  # leaves before the tests
    "import os\ndef f(x):\n    return 2 * x\nos._exit(0)": 0,
    "def f(x):\n    return 2 * x\nprint('0 0 1')\nprint('0 2 1')": 2,  # a forged report
    "import os\ndef f(x):\n    assert not [k for k in os.environ if 'SECRET' in k]\n"
    "    return 7 if x == 3 else 2 * x": 3,  # it sees none of the trainer's variables
}
WORST = {  # programs cut by a limit: no test passes
    "while True:\n    pass": 0,
    "import time\ntime.sleep(60)": 0,
    "x = bytearray(8 * 1024 ** 3)": 0,
    "import os\nwhile True:\n    os.fork()": 0,
}


def test_code_tests_give_the_fraction_of_tests_each_program_passes(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    item = ObsBundle("write f", ASSERTS)
    programs = list(PROGRAMS)
    assert code_tests(programs, [item] * len(programs)) == [
        PROGRAMS[p] / 3 for p in programs]
    assert code_tests_all(programs, [item] * len(programs)) == [
        float(PROGRAMS[p] == 3) for p in programs]
    limits = Limits(timeout_s=1.0, memory_mb=256)
    assert fraction_passed(list(WORST), [item] * len(WORST), limits=limits) == [0.0] * len(WORST)


def test_stdin_stdout_tests_and_the_tests_column():
    pairs = json.dumps([{"input": "3\n", "output": "6"}, {"input": "5", "output": "10\n"},
                        {"input": "0", "output": "1"}])
    doubling = "n = int(input())\nprint(2 * n)"
    assert code_tests([doubling], [ObsBundle("p", pairs)]) == [2 / 3]
    item = ObsBundle("p", "ignored", metadata={"tests": ["assert g() == 1", "assert g() == 2"]})
    assert code_tests(["def g():\n    return 1"], [item]) == [0.5]
    assert program_of("a\n```py\nx = 1\n```\nb\n```python\ny = 2\n```\n") == "y = 2\n"


@pytest.fixture
def hostile(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    sets = []

    def build(**keys):
        rs = build_rewards(RewardConfig(functions=["tests.extmods.sandboxed.misbehaves"],
                                        isolation="process", sample_timeout_s=2.0,
                                        memory_mb=512, workers=2, **keys))
        sets.append(rs)
        return rs

    yield build
    for rs in sets:
        pids = [w.proc.pid for pool in rs._pool for w in pool.workers]
        rs.close()
        assert wait_gone(pids) == []


def test_process_isolation_contains_each_way_a_sample_can_fail(hostile):
    rs = hostile()
    texts = ["ok", "loop", "sleep", "bomb", "exit", "segv", "fork", "raise", "nan", "env",
             "cwd", "cwd", "fine!"]
    total, parts = rs.score(texts, [ObsBundle("q")] * len(texts))
    # loop and sleep are cut at 2 s, bomb meets the memory limit, exit and segv end their
    # worker, raise and nan have no value: 0 each. The fork's value stands (its worker, with
    # the child it left, is replaced); env sees no SECRET variable; each sample's folder is
    # fresh (one file: its own).
    assert total == [2.0, 0, 0, 0, 0, 0, 4.0, 0, 0, 0.0, 1.0, 1.0, 5.0]
    name = "tests.extmods.sandboxed.misbehaves"
    assert parts[f"reward/failed/{name}"] == 7.0
    pool = rs._pool[0]
    assert len(pool.workers) == 2  # the ones that died or overran were replaced
    again, _ = rs.score(["ok", "fine!"], [ObsBundle("q")] * 2)
    assert again == [2.0, 5.0]


def test_on_error_fail_stops_the_step_naming_the_function_and_the_item(hostile):
    rs = hostile(on_error="fail")
    with pytest.raises(RewardFailure) as caught:
        rs.score(["ok", "raise", "fine"], [ObsBundle("q")] * 3, step=4)
    line = str(caught.value)
    assert "misbehaves" in line and "item 1" in line and "ValueError: no score" in line
    assert "step 4" in line and "\n" not in line.strip()


def test_a_sigkilled_trainer_leaves_no_reward_process(tmp_path):
    script = textwrap.dedent("""
        from runner.recipe.schema import RewardConfig
        from runner.rewards import build_rewards
        from runner.types import ObsBundle
        rs = build_rewards(RewardConfig(functions=["tests.extmods.sandboxed.misbehaves"],
                                        isolation="process", sample_timeout_s=600, workers=2))
        print("scoring", flush=True)
        rs.score(["sleep", "fork", "sleep"], [ObsBundle("q")] * 3)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "scoring"
    deadline = time.monotonic() + 60
    while len(descendants(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the workers are inside their samples (one has forked)
    family = descendants(proc.pid) - {proc.pid}
    assert len(family) >= 2, family
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_gone(sorted(family), timeout_s=10) == []


def test_the_keys_and_their_refusals():
    recipe = load_recipe(REPO / "recipes/grpo-arith.toml",
                         ["reward.functions=['code_tests']"])
    rs = build_rewards(recipe.reward)
    assert rs.isolation == "process" and rs.limits == Limits(10.0, 1024)
    assert build_rewards(load_recipe(REPO / "recipes/grpo-arith.toml").reward).isolation == \
        "thread"
    with pytest.raises(Exception) as caught:
        load_recipe(REPO / "recipes/grpo-arith.toml",
                    ["reward.memory_mb=10", "reward.sample_timeout_s=0", "reward.workers=-1"])
    text = str(caught.value)
    assert all(k in text for k in ("reward.memory_mb", "reward.sample_timeout_s",
                                   "reward.workers"))


def test_a_run_scores_alike_in_worker_processes(tmp_path):
    """A step of GRPO with the rewards in worker processes trains exactly as with them in the
    trainer's threads."""
    common = ("run.max_steps=1", "algo.prompts_per_step=4", "algo.group_size=4",
              "rollout.max_new_tokens=4", "data.validation.enabled=false",
              "logging.sample_every=0")
    for isolation in ("thread", "process"):
        done = run_cli("recipes/grpo-arith.toml", tmp_path / isolation, *common,
                       f"reward.isolation={isolation}", "reward.workers=2")
        assert done.returncode == 0, done.stdout + done.stderr
    threads, workers = (deterministic_rows(tmp_path / k) for k in ("thread", "process"))
    assert [r["reward/mean"] for r in threads] == [r["reward/mean"] for r in workers]
    assert all(r["reward/failed/arithmetic_exact"] == 0 for r in workers)
    a, b = final_weights(tmp_path / "thread", 1), final_weights(tmp_path / "process", 1)
    assert all((a[k] == b[k]).all() for k in a)
