"""The pieces of a multi-rank run that need no second process: the rank context, the global
row layout and minibatches, the setup handshake, stale temporary checkpoint folders."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from runner.errors import RunnerError
from runner.launch.torchrun import rank_env
from runner.ranks.collective import Collective, interleave
from runner.ranks.context import RankContext
from runner.state.checkpoint import _remove_stale
from runner.state.layout import TMP_PREFIX
from runner.train.assembly.handshake import handshake
from runner.train.loops.batches import Layout, minibatches


def test_rank_context_from_env():
    assert RankContext.from_env({}) is None
    ctx = RankContext.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert ctx == RankContext(1, 2, 1) and not ctx.is_main
    with pytest.raises(RunnerError, match="not a valid rank layout"):
        RankContext.from_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError):
        RankContext(2, 2, 0)


def test_rank_env_is_loopback_and_torchrun_shaped():
    env = rank_env(1, 2, 12345, "run")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_single_rank_collective_is_the_identity():
    comm = Collective(RankContext())
    assert comm.sum([1.5, 2]) == [1.5, 2.0] and comm.gather("x") == ["x"] and not comm.any(False)


def test_interleave_restores_global_order():
    # 3 items of 2 samples over 2 ranks: rank 0 holds items 0 and 2, rank 1 item 1
    assert interleave([["a0", "a1", "c0", "c1"], ["b0", "b1"]], chunk=2) == \
        ["a0", "a1", "b0", "b1", "c0", "c1"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layout_maps_local_rows_to_global_rows(world):
    items, chunk = 8, 3
    seen = []
    for rank in range(world):
        layout = Layout(rank, world, items, chunk)
        rows = [layout.global_row(i) for i in range(items // world * chunk)]
        assert layout.local_rows(torch.tensor(rows)) == list(range(len(rows)))
        seen += rows
    assert sorted(seen) == list(range(items * chunk))


def test_minibatches_are_the_same_rows_on_any_world_size():
    items, chunk, weights = 8, 2, [float(i % 5 + 1) for i in range(16)]
    single = minibatches(Layout(0, 1, items, chunk), weights, 3, generator_seed=11)
    for world in (2, 4):
        parts = [minibatches(Layout(r, world, items, chunk), weights, 3, generator_seed=11)
                 for r in range(world)]
        for m, one in enumerate(single):
            union = sorted(Layout(r, world, items, chunk).global_row(i)
                           for r in range(world) for i in parts[r][m].rows)
            assert union == sorted(one.rows)  # world 1: local rows are global rows
            assert all(parts[r][m].total == one.total for r in range(world))
            assert one.total == sum(weights[g] for g in one.rows)


class _Comm:
    def __init__(self, others):
        self.others = others

    def gather(self, mine):
        return [mine, *self.others]


def _entry(failed=None, data="d", models=None):
    return {"failed": failed, "data": data, "models": models or {"policy": "h"}}


def test_handshake_names_the_rank_and_role_that_failed():
    comm = _Comm([_entry(failed=["data", "ValueError: rank one cannot build"])])
    with pytest.raises(RunnerError, match="rank 1 failed to build its data: ValueError: rank one"):
        handshake(comm, RankContext(0, 2), None, "d", {"policy": "h"})


def test_handshake_reraises_the_own_failure():
    comm = _Comm([_entry()])
    with pytest.raises(OSError, match="disk"):
        handshake(comm, RankContext(0, 2), ("policy", OSError("disk")), "d", {"policy": "h"})


def test_handshake_refuses_other_model_files_or_data():
    with pytest.raises(RunnerError, match="rank 1's teacher model files differ"):
        handshake(_Comm([_entry(models={"policy": "h", "teacher": "x"})]), RankContext(0, 2), None,
                  "d", {"policy": "h", "teacher": "y"})
    with pytest.raises(RunnerError, match="rank 1 built other training data"):
        handshake(_Comm([_entry(data="e")]), RankContext(0, 2), None, "d", {"policy": "h"})
    handshake(_Comm([_entry()]), RankContext(0, 2), None, "d", {"policy": "h"})  # all equal


def test_stale_temporary_folders_of_live_writers_are_kept(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout.strip()
        (tmp_path / f"{TMP_PREFIX}step-000003-{live.pid}").mkdir()
        (tmp_path / f"{TMP_PREFIX}step-000002-{dead}").mkdir()
        (tmp_path / f"{TMP_PREFIX}step-000001-{os.getpid()}").mkdir()
        _remove_stale(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"{TMP_PREFIX}step-000003-{live.pid}"]
    finally:
        live.kill()
        live.wait()


# --- the Ray backend's pure parts (no Ray needed) ------------------------------------------

def test_version_check_names_the_actor_and_each_package():
    from runner.launch.ray_backend import check_versions, version_mismatches

    driver = {"python": "3.11.7", "torch": "2.13.0", "ray": "2.60.0"}
    assert version_mismatches(driver, dict(driver)) == []
    assert version_mismatches(driver, {**driver, "torch": "2.12.1"}) == [
        "torch 2.12.1 (driver 2.13.0)"]
    check_versions(driver, {"rank 0": {"ip": "127.0.0.1", "versions": dict(driver)}})
    bad = {"rank 0": {"ip": "127.0.0.1", "versions": dict(driver)},
           "rollout actor 0": {"ip": "10.0.0.2", "versions": {"python": "3.11.7",
                                                               "torch": "2.13.0"}}}
    with pytest.raises(RunnerError) as err:
        check_versions(driver, bad)
    assert str(err.value) == ("the actors run other package versions than the driver: rollout "
                              "actor 0 (node 10.0.0.2): ray missing (driver 2.60.0). Install the "
                              "same versions on every node")


def test_ray_local_ranks_and_runtime_env(monkeypatch):
    from runner.launch.ray_backend import _local_ranks
    from runner.launch.ray_env import runtime_env
    from runner.recipe import load_recipe

    assert _local_ranks(["a", "b", "a", "b", "a"]) == [0, 0, 1, 1, 2]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("PYTHONPATH", "/src")
    recipe = load_recipe("recipes/grpo-arith.toml", [
        "launch.backend=ray", "launch.num_processes=2",
        "launch.ray_runtime_env={working_dir = '.', env_vars = {OMP_NUM_THREADS = '2'}}"])
    env = runtime_env(recipe, 2)
    assert env["working_dir"] == "."
    assert env["env_vars"]["OMP_NUM_THREADS"] == "2"  # the recipe's own value wins
    assert env["env_vars"]["PYTHONPATH"] == "/src"


def test_a_driver_without_a_ray_token_is_told_where_the_token_goes(monkeypatch, tmp_path):
    """A cluster with token authentication (Ray's default) refuses a driver that has no token;
    the one line says so and where the token goes. (Joining with a token: tests/test_ray.py.)"""
    import socket

    ray = pytest.importorskip("ray")
    from runner.launch import ray_backend
    from runner.recipe import load_recipe

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token

    def refused(*args, **kwargs):
        raise ConnectionError("Failed to connect to Ray cluster")

    monkeypatch.setattr(ray, "init", refused)
    with socket.socket() as listening:  # the probe finds something there
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        recipe = load_recipe("recipes/grpo-arith.toml", [
            "launch.backend=ray", "launch.num_processes=2", f"launch.ray_address={address}"])
        with pytest.raises(RunnerError) as err:
            ray_backend._init_ray(recipe, ())
        assert str(err.value) == (
            f"launch.ray_address: cannot join the Ray cluster at '{address}': Failed to connect "
            "to Ray cluster. No Ray token was found here: a cluster with token authentication "
            "(Ray's default) refuses such a driver; copy its token (`ray get-auth-token` on its "
            "head) to ~/.ray/auth_token, or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user turned authentication off
        with pytest.raises(RunnerError) as err:
            ray_backend._init_ray(recipe, ())
        assert str(err.value).endswith("Failed to connect to Ray cluster")


def test_stop_requests_poll_the_launcher_once_requested():
    from runner.train.loops.loop import StopRequests
    from runner.ui import SilentReporter

    calls = []

    def poll() -> bool:
        calls.append(1)
        return len(calls) >= 2

    stop = StopRequests(SilentReporter(), poll)
    assert stop.requested is False and stop.requested is True and stop.requested is True
    assert len(calls) == 2  # a stop once seen is kept, the launcher is not asked again
