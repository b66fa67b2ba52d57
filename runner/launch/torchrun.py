"""``launch.backend = "torchrun"``: start N ranks of the rank program on this machine.

The driver (the ``posttrain-run`` process) has validated the recipe and imported every dotted
path before this runs. It then hosts the rendezvous store itself, on 127.0.0.1 and a free port
(torch's own launcher binds its store on every interface), starts one worker process per rank
with the environment torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``), and watches them:

- each worker gets plain data only (a payload file: the resolved recipe text, its hash, the
  overrides, the working directory) and builds its own objects from it;
- the first Ctrl-C / SIGTERM is passed to every rank once (the ranks agree on a step to stop
  after and rank 0 checkpoints it); a second one kills them;
- when a rank dies, the survivors are stopped within seconds and the driver exits 1 naming it
  in one line. A rank that fails with an error none of the project's (a collective broken by
  the dead rank) prints nothing: its traceback is in ``<output_dir>/logs/``, and the line
  names the file. A rank whose process is stopped (SIGSTOP) is named as the one that stopped
  answering, not the rank whose collective timed out waiting for it.
Workers die with the driver (PR_SET_PDEATHSIG), so a killed job leaves no orphans.

On Linux, ranks that train on the CPU are forked from one warm process (``runner.launch.zygote``)
that imported torch and the training modules once, instead of each importing them: the driver
becomes a child subreaper and adopts them (``Adopted``). GPU ranks, ``POSTTRAIN_RANK_START=spawn``
and a zygote that cannot fork start each rank as a fresh ``python -m runner.launch.worker``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from runner.errors import RunnerError
from runner.launch.payload import Payload
from runner.precision import device_type

LOOPBACK = "127.0.0.1"
# After one rank fails, how long the others get to notice (a broken collective) and exit
# before they are killed.
GRACE_S = 3.0
POLL_S = 0.05


def loopback_store(timeout_s: float) -> tuple[object, int, socket.socket]:
    """A TCPStore server listening on 127.0.0.1 only (a socket bound here is handed to it)."""
    return listening_store(LOOPBACK, timeout_s)


def listening_store(host: str, timeout_s: float) -> tuple[object, int, socket.socket]:
    """A TCPStore server listening on ``host`` only, on a free port: (store, port, socket)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, is_master=True, master_listen_fd=sock.fileno(),
                          wait_for_workers=False, multi_tenant=True,
                          timeout=timedelta(seconds=timeout_s))
    return store, port, sock


def rank_env(rank: int, world: int, port: int, run_id: str) -> dict[str, str]:
    """The environment of one local rank, as torchrun sets it (plus loopback-only gloo)."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))
    return {
        **os.environ,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_RUN_ID": run_id, "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": threads, "POSTTRAIN_DRIVER_PID": str(os.getpid()),
    }


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP, a debugger): Linux's
    ``/proc/PID/stat`` state T or t; False where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()
    return bool(fields) and fields[0] in ("T", "t")


def _last_line(path: Path) -> str:
    lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return lines[-1].strip() if lines else "(empty)"


class Adopted:
    """A rank forked by the zygote and adopted by this process (a child subreaper): the part of
    ``subprocess.Popen`` the launcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(POLL_S)
        return self.returncode  # type: ignore[return-value]


def _subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); whether it is."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0


def fork_ranks(payload_path: Path, cwd: str, envs: list[dict[str, str]], device: str
               ) -> list[Adopted] | None:
    """The ranks forked by one zygote (``runner.launch.zygote``), adopted by this process; None
    where they are not: ranks that train on a GPU (CUDA may not be used in a process forked
    after the CUDA driver was initialised, and a GPU rank's start is not dominated by its
    imports), ``POSTTRAIN_RANK_START=spawn``, not Linux, or a zygote that failed (it said why
    on stderr)."""
    if (device != "cpu" or os.environ.get("POSTTRAIN_RANK_START", "fork") == "spawn"
            or not _subreaper()):
        return None
    read, write = os.pipe()
    try:
        zygote = subprocess.Popen([sys.executable, "-m", "runner.launch.zygote", str(write)],
                                  env=envs[0], cwd=cwd, stdin=subprocess.PIPE,
                                  pass_fds=(write,), start_new_session=True)
    finally:
        os.close(write)
    with os.fdopen(read) as report:
        assert zygote.stdin is not None
        zygote.stdin.write(json.dumps({"payload": str(payload_path), "cwd": cwd,
                                       "driver": os.getpid(), "envs": envs}).encode())
        zygote.stdin.close()
        text = report.read()
    code = zygote.wait()
    pids = json.loads(text) if code == 0 and text else []
    return [Adopted(pid) for pid in pids] if len(pids) == len(envs) else None


class _Ranks:
    """The worker processes and what the driver does with them. ``logs``: the run folder's
    ``logs/``, where a rank writes the traceback of an error none of the project's;
    ``timeout_s``: ``launch.collective_timeout_s``."""

    def __init__(self, procs: list[subprocess.Popen | Adopted], logs: Path | None = None,
                 timeout_s: float = 0.0) -> None:
        self.procs = procs
        self.signals = 0
        self.logs = logs
        self.timeout_s = timeout_s
        self.started = time.time()

    def tracebacks(self) -> dict[int, Path]:
        """The traceback files the ranks of this job wrote, by rank."""
        from runner.launch.worker import traceback_path

        if self.logs is None:
            return {}
        found = {}
        for rank in range(len(self.procs)):
            path = traceback_path(self.logs.parent, rank)
            try:
                if path.stat().st_mtime >= self.started - 1:
                    found[rank] = path
            except OSError:
                continue
        return found

    def blame(self, rank: int, code: int, stopped: list[int]) -> str:
        """The one line for a job that rank ``rank`` ended with ``code``; ``stopped``: the
        ranks whose processes were stopped when it did."""
        from runner.launch.worker import EXIT_TRACEBACK

        logs = self.tracebacks()
        why = (f"failed with {_last_line(logs[rank])} (traceback: {logs[rank]})"
               if code == EXIT_TRACEBACK and rank in logs else _describe(code))
        resume = ("The latest complete checkpoint is intact: run the same command again to "
                  "resume")
        culprits = [r for r in stopped if r != rank]
        if culprits:
            k = culprits[0]
            return (f"rank {k} (pid {self.procs[k].pid}) stopped answering (its process is "
                    f"stopped, e.g. by SIGSTOP): rank {rank} waited for it in a collective for "
                    f"up to launch.collective_timeout_s = {self.timeout_s:g} s, then {why}; the "
                    f"ranks were stopped. {resume}")
        others = [str(p) for r, p in sorted(logs.items()) if r != rank]
        seen = f" (their tracebacks: {', '.join(others)})" if others else ""
        return (f"rank {rank} (pid {self.procs[rank].pid}) {why}; the other ranks were "
                f"stopped{seen}. {resume}")

    def forward(self, signum: int, frame: object) -> None:
        self.signals += 1
        sig = signum if self.signals == 1 else signal.SIGKILL
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()

    def watch(self) -> int:
        """Wait for every rank; the job's exit code. A failed rank stops the others."""
        from runner.launch.worker import EXIT_TRACEBACK

        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c is not None and c not in (0, 130)]
            if failed and self.signals >= 2:  # a second Ctrl-C killed them: the user's stop
                self.kill()
                return 130
            if failed:
                # Seen in one poll, a rank killed by a signal is the cause, then a rank that
                # failed with an error of its own (printed: a user's os._exit, a reward), and the
                # ranks whose collectives then broke (tracebacks in files) its consequence,
                # whatever their numbers.
                rank, code = min(failed, key=lambda rc: (rc[1] >= 0, rc[1] == EXIT_TRACEBACK,
                                                         rc[0]))
                stopped = [r for r, p in enumerate(self.procs)
                           if p.poll() is None and is_stopped(p.pid)]
                deadline = time.monotonic() + GRACE_S
                while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                    time.sleep(POLL_S)
                self.kill()
                if code == 2 and all(p.returncode == 2 for p in self.procs):
                    return 2  # the same recipe error on every rank (already printed by each)
                raise RunnerError(self.blame(rank, code, stopped))
            if all(c is not None for c in codes):
                return 130 if 130 in codes else 0
            time.sleep(POLL_S)


def launch_torchrun(payload: Payload, world: int, timeout_s: float) -> int:
    """Run ``world`` ranks of the payload's recipe on this machine; returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="posttrain-launch-") as tmp:
        path = Path(tmp) / "payload.json"
        payload.write(path)
        store, port, sock = loopback_store(timeout_s)
        run_id = f"posttrain-{os.getpid()}-{port}"
        cmd = [sys.executable, "-m", "runner.launch.worker", str(path)]
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        procs: list[subprocess.Popen | Adopted] = []
        recipe = payload.recipe()
        logs = Path(payload.cwd) / recipe.run.output_dir / "logs"
        ranks = _Ranks(procs, logs, timeout_s)
        try:
            for s in old:
                signal.signal(s, ranks.forward)
            envs = [rank_env(rank, world, port, run_id) for rank in range(world)]
            procs += fork_ranks(path, payload.cwd, envs, device_type(recipe)) or [
                subprocess.Popen(cmd, env=env, cwd=payload.cwd, start_new_session=True)
                for env in envs]
            if ranks.signals:  # a Ctrl-C that came while they started: theirs now
                for p in procs:
                    os.killpg(p.pid, signal.SIGINT)
            return ranks.watch()
        finally:
            ranks.kill()
            for s, handler in old.items():
                signal.signal(s, handler)
            del store  # the store owns the listening socket and closes it
            sock.detach()

