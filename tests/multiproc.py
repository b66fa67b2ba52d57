"""Helpers for the multi-process tests: run the CLI on N ranks, read what the runs logged."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tests import forkserver
from tests.conftest import REPO
from tests.resume_helpers import CLI, _env


def run_ranks(recipe: str, out: Path, world: int, *overrides: str, timeout: float = 600
              ) -> subprocess.CompletedProcess:
    """``posttrain-run`` with ``launch.backend=torchrun`` on ``world`` ranks (1: local)."""
    launch = ("launch.backend=torchrun", f"launch.num_processes={world}") if world > 1 else ()
    return forkserver.run([*CLI, recipe, f"run.output_dir={out}", *launch, *overrides], cwd=REPO,
                          env=_env(), timeout=timeout)


def start_ranks(recipe: str, out: Path, world: int, *overrides: str
                ) -> subprocess.Popen | forkserver.ForkedRun:
    launch = ("launch.backend=torchrun", f"launch.num_processes={world}") if world > 1 else ()
    return forkserver.popen([*CLI, recipe, f"run.output_dir={out}", *launch, *overrides],
                            cwd=REPO, env=_env(), start_new_session=True)


def run_external(recipe: str, out: Path, world: int, *overrides: str, timeout: float = 600
                 ) -> list[subprocess.CompletedProcess]:
    """Launch ``python -m runner.cli`` once per rank with exactly the environment torchrun gives
    its workers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, the agent store), the test
    itself hosting the rendezvous store on 127.0.0.1 (torchrun's own store would listen on every
    interface)."""
    from runner.launch.torchrun import loopback_store

    store, port, sock = loopback_store(120)
    procs = []
    for rank in range(world):
        env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": f"test-{port}",
               "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen([*CLI, recipe, f"run.output_dir={out}", *overrides], cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env))
    done = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            p.kill()
        del store
        sock.detach()
    return done


def item_ids(out: Path) -> list[list]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return [r["data/item_ids"] for r in rows if "data/item_ids" in r]


def listeners_of(pids: set[int]) -> list[str]:
    """Local addresses on which the processes ``pids`` listen (TCP), from ``ss``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        if any(f"pid={p}," in line for p in pids):
            found.append(line.split()[3])
    return found


def self_served(pids: set[int]) -> dict[int, set[str]]:
    """For each of ``pids``, the local addresses on which it listens that it is itself connected
    to (a server it runs for its own clients, e.g. the agents' endpoint), from ``ss``."""
    out = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True).stdout
    listening: dict[int, set[str]] = {}
    peers: dict[int, set[str]] = {}
    for line in out.splitlines():
        fields = line.split()
        owners = {int(p.split(",")[0]) for p in line.split("pid=")[1:]} & pids
        for pid in owners:
            if fields[0] == "LISTEN":
                listening.setdefault(pid, set()).add(fields[3])
            elif fields[0] == "ESTAB":
                peers.setdefault(pid, set()).add(fields[4])
    return {pid: listening.get(pid, set()) & peers.get(pid, set()) for pid in pids}


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(stat[1])
    found, grew = {pid}, True
    while grew:
        new = {child for child, parent in parent_of.items() if parent in found} - found
        found |= new
        grew = bool(new)
    return found



def alive(pids: set[int] | list[int]) -> set[int]:
    """The processes of ``pids`` still running (zombies count as gone)."""
    out = set()
    for pid in pids:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def wait_gone(pids: set[int] | list[int], timeout_s: float = 5.0) -> list[int]:
    """The processes of ``pids`` still running after ``timeout_s``, sorted."""
    deadline = time.monotonic() + timeout_s
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = alive(left)
    return sorted(left)
