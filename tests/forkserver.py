"""CLI runs forked from a warm interpreter, for the test suite's many short runs.

Most multi-step tests run ``python -m runner.cli`` as a process of its own: they read its exit
code and output, interrupt it, SIGKILL it at chosen points and compare what it wrote. Starting
Python and importing torch and transformers is about 4 s of every such run, most of a tiny
run's time. So each test worker starts a server process that imports those libraries once,
with the environment the test helpers give the CLI (two at most, for two environments), and
each run is a fork of it:

- the fork restores the run's environment, enters its working directory, takes the pipes the
  test gave it as its stdin/stdout/stderr (and a session of its own when asked), then runs
  ``runner.cli`` as ``python -m`` does (``runpy``, ``SystemExit``, atexit handlers, death by an
  uncaught Ctrl-C);
- it is a real process: its own pid (the one a test signals, and the one a checkpoint's
  temporary folder names), its own file descriptors, exit status and children.

A reaper process between the server and the run waits for the run and reports its status, so
``ForkedRun`` answers like ``subprocess.Popen`` (``poll``, ``wait``, ``communicate``,
``send_signal``, ``kill``, ``returncode`` negative for a signal).

Only the libraries are shared: no runner module is imported before the fork. A run whose
environment or command differs from what the server serves starts the ordinary way
(``subprocess``), and so does every run with ``POSTTRAIN_TEST_FORK=0``. The CLI's own tests of
start-up (``tests/test_cli.py``) run the installed ``posttrain-run`` the ordinary way too.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

PRELOAD = ("torch", "numpy", "safetensors.torch", "accelerate", "transformers",
           "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto")
MODULE = "runner.cli"  # the one command the server runs: python -m runner.cli ...
_MAX_MESSAGE = 1 << 20


# ----------------------------------------------------------------------------- the server side

def _serve(sock: socket.socket) -> None:
    """Fork a reaper for each request until the test process closes its end."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # reapers are reaped by the kernel
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 4)
        except (ConnectionResetError, OSError):
            return
        if not msg:
            return
        request = json.loads(msg)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            try:
                _reap(sock, request, fds)
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)


def _reap(server: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the reaper: fork the run, tell the test its pid, wait for it, report its status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    server.close()
    stdin, stdout, stderr, chan = fds
    entered, told = os.pipe()  # the run says it has its session and streams, as exec would
    pid = os.fork()
    if pid == 0:
        try:
            os.close(chan)
            os.close(entered)
            _run(request, stdin, stdout, stderr, told)
        finally:
            os._exit(1)  # only reached when entering the run failed
    for fd in (stdin, stdout, stderr, told):
        os.close(fd)
    os.read(entered, 1)  # b"" if the run died first: its status follows all the same
    os.close(entered)
    report = socket.socket(fileno=chan)
    try:
        report.sendall(f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        report.sendall(f"status {status}\n".encode())
    finally:
        os._exit(0)


def _run(request: dict[str, Any], stdin: int, stdout: int, stderr: int, told: int) -> None:
    """In the run's process: become ``python -m runner.cli ARGS`` started in ``cwd`` with
    ``env``, and leave the way that interpreter would."""
    import runpy
    import traceback

    if request["new_session"]:
        os.setsid()
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    for fd in {stdin, stdout, stderr}:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # what -m puts first
    sys.argv = ["-m", *request["args"]]
    os.write(told, b"1")
    os.close(told)
    code: int = 0
    try:
        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:  # as Python does: the traceback, then death by SIGINT
        traceback.print_exc()
        _leave()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - an uncaught error ends the interpreter with 1
        traceback.print_exc()
        code = 1
    _leave()
    os._exit(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _leave() -> None:
    """What interpreter shutdown runs before the process ends: waiting for non-daemon threads,
    the atexit handlers (Ray's shutdown among them), flushing the standard streams."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        __import__(name)
    sock.sendall(b"ready")
    _serve(sock)


# ------------------------------------------------------------------------------- the test side

class ForkedRun:
    """A forked CLI run, answering like ``subprocess.Popen`` (text mode)."""

    def __init__(self, args: list[str], chan: socket.socket, stdout: IO[str] | None,
                 stderr: IO[str] | None) -> None:
        self.args = args
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None
        self._chan = chan
        self._buffer = b""
        self.pid = int(self._line(None).split()[1])

    def _line(self, timeout: float | None) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._chan.settimeout(left)
            try:
                chunk = self._chan.recv(4096)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: a timeout of 0
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise RuntimeError(f"the fork server lost the run {self.args}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            status = int(self._line(timeout).split()[1])
            self.returncode = os.waitstatus_to_exitcode(status)
            self._chan.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.wait(0)
            except subprocess.TimeoutExpired:
                return None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read stdout and stderr to their ends, then wait for the exit status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[str, str] = {}
        readers = []
        for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)):
            if stream is not None:
                def read(name: str = name, stream: IO[str] = stream) -> None:
                    results[name] = stream.read()
                    stream.close()
                reader = threading.Thread(target=read, daemon=True)
                reader.start()
                readers.append(reader)
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("stdout"), results.get("stderr")


class Server:
    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", str(theirs.fileno())], cwd=cwd, env=env,
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        ours.settimeout(300)
        if ours.recv(16) != b"ready":
            raise RuntimeError("the test fork server did not start")
        ours.settimeout(None)

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def start(self, args: list[str], cwd: Path, env: dict[str, str], merge_stderr: bool,
              new_session: bool) -> ForkedRun:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if not merge_stderr else (None, out_w)
        chan_test, chan_run = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stdin = os.open(os.devnull, os.O_RDONLY)
        request = {"args": args, "cwd": str(cwd), "env": env, "new_session": new_session}
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()],
                            [stdin, out_w, err_w, chan_run.fileno()])
        finally:
            for fd in {stdin, out_w, err_w}:
                os.close(fd)
            chan_run.close()
        stdout = open(out_r)  # noqa: SIM115 - owned by the ForkedRun, like Popen's pipes
        stderr = open(err_r) if err_r is not None else None  # noqa: SIM115
        return ForkedRun([sys.executable, "-m", MODULE, *args], chan_test, stdout, stderr)


_SERVERS: dict[str, Server] = {}


def _server_for(cmd: Sequence[str], env: dict[str, str], cwd: Path) -> Server | None:
    """The server for this command and environment, started on first use; None where the run
    must start the ordinary way."""
    if os.environ.get("POSTTRAIN_TEST_FORK", "1") == "0":
        return None
    if list(cmd[:3]) != [sys.executable, "-m", MODULE]:
        return None
    key = _key(env)
    server = _SERVERS.get(key)
    if server is None:
        if len(_SERVERS) >= 2:  # a third environment in one worker runs the ordinary way
            return None
        server = _SERVERS[key] = Server(env, cwd)
        atexit.register(server.close)
    return server


# Variables a run may set apart from the server's: read by the runner while it runs, never by
# the preloaded libraries on import (PYTEST_CURRENT_TEST changes with every test). The trackers'
# libraries (W&B, MLflow) and Ray are imported by the run itself, never preloaded: a Ray driver
# forks from the same server as the torchrun runs, whatever cluster, token or session folder
# its RAY_* variables name.
_RUN_TIME_ONLY = ("COLUMNS", "LINES", "POSTTRAIN_HOME", "POSTTRAIN_RANK_START")
_RUN_TIME_PREFIXES = ("PYTEST_", "WANDB_", "MLFLOW_", "RAY_")


def _key(env: dict[str, str]) -> str:
    """What must match for a run to fork from a server: the environment, less the variables
    that only the run reads (``_RUN_TIME_ONLY``, ``_RUN_TIME_PREFIXES``)."""
    return json.dumps({k: v for k, v in env.items()
                       if not k.startswith(_RUN_TIME_PREFIXES) and k not in _RUN_TIME_ONLY},
                      sort_keys=True)


def popen(cmd: Sequence[str], *, cwd: Path, env: dict[str, str], merge_stderr: bool = True,
          start_new_session: bool = False, server: Server | None = None
          ) -> ForkedRun | subprocess.Popen:
    """Start the CLI like ``subprocess.Popen(cmd, stdout=PIPE, stderr=STDOUT or PIPE,
    text=True)``: forked from ``server`` (default: this worker's for ``env``), or started."""
    server = server or _server_for(cmd, env, cwd)
    if server is None:
        return subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                                text=True, start_new_session=start_new_session)
    return server.start(list(cmd[3:]), cwd, env, merge_stderr, start_new_session)


def run(cmd: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float,
        server: Server | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` for the CLI."""
    server = server or _server_for(cmd, env, cwd)
    if server is None:
        return subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    proc = popen(cmd, cwd=cwd, env=env, merge_stderr=False, server=server)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    code = proc.wait()
    return subprocess.CompletedProcess(list(cmd), code, out, err)


if __name__ == "__main__":
    main()
