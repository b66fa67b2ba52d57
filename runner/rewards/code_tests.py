"""The ``code_tests`` rewards: run the model's program against the item's tests.

The program is the completion's last fenced Python block (```` ```python ... ``` ```` or a bare
```` ``` ```` fence), or the whole completion when it has none. The tests come from the item's
``tests`` metadata, else its reference answer, written either as Python statements (one test per
``assert`` line, run after the program in its namespace) or as a JSON list of
``{"input": ..., "output": ...}`` pairs (the program reads the input on stdin; it passes when its
stdout, stripped, equals the output, stripped).

``code_tests`` is the fraction of tests passed, ``code_tests_all`` 1.0 only when every test
passes. Each completion runs in a child Python of its own (``runner.rewards.sandbox``: its own
session, a fresh temporary folder, closed stdin, no variable of the trainer's environment, an
address-space, CPU-time and file-size limit, killed with everything it started at the time
limit). A test passes only when the child reports it: a program that exits early, crashes or
runs out of time passes the tests it reported before that. The report goes through a pipe of its
own, each line marked with a random token the program is not given.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.rewards.sandbox import Limits, child_env, kill_group, python_argv
from runner.types import ObsBundle

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# The child: it limits itself, then runs the program and each test, reporting every result on
# its report pipe as it goes. A watchdog ends it when its parent is gone.
HARNESS = r"""
import io, json, os, resource, sys, threading, time
def _watch(parent):
    while os.getppid() == parent:
        time.sleep(0.2)
    os.killpg(0, 9)
def _main():
    spec = json.loads(sys.stdin.readline())
    threading.Thread(target=_watch, args=(spec["parent"],), daemon=True).start()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdin = open(os.devnull)
    report = os.fdopen(spec["fd"], "w")
    mark = spec["mark"]
    for which, value in ((resource.RLIMIT_AS, spec["memory"]), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_FSIZE, spec["fsize"]),
                         (resource.RLIMIT_CPU, spec["cpu"])):
        resource.setrlimit(which, (value, resource.getrlimit(which)[1]))
    def say(i, ok):
        report.write(f"{mark} {i} {int(ok)}\n")
        report.flush()
    program = spec["program"]
    try:
        code = compile(program, "<program>", "exec")
    except BaseException:
        code = None
    if spec["asserts"] is not None:
        scope = {"__name__": "__main__"}
        loaded = False
        if code is not None:
            try:
                exec(code, scope)
                loaded = True
            except BaseException:
                pass
        for i, test in enumerate(spec["asserts"]):
            ok = False
            if loaded:
                try:
                    exec(compile(test, "<test>", "exec"), scope)
                    ok = True
                except BaseException:
                    pass
            say(i, ok)
        return
    for i, (given, wanted) in enumerate(spec["io"]):
        ok = False
        if code is not None:
            out, real = io.StringIO(), (sys.stdin, sys.stdout)
            sys.stdin, sys.stdout = io.StringIO(given), out
            try:
                exec(code, {"__name__": "__main__"})
                ok = out.getvalue().strip() == wanted.strip()
            except BaseException:
                ok = False
            finally:
                sys.stdin, sys.stdout = real
        say(i, ok)
_main()
"""


def program_of(completion: str) -> str:
    """The completion's last fenced Python block, or the whole completion.

    >>> program_of("first\\n```python\\nx = 1\\n```\\nthen\\n```\\ny = 2\\n```")
    'y = 2\\n'
    >>> program_of("def f(x):\\n    return x")
    'def f(x):\\n    return x'
    """
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def tests_of(item: ObsBundle) -> tuple[list[str] | None, list[tuple[str, str]] | None]:
    """(assert statements, None) or (None, stdin/stdout pairs): the item's ``tests``."""
    raw: Any = item.metadata.get("tests", item.reference) if item.metadata else item.reference
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return [line for line in raw.splitlines() if line.strip()], None
    if isinstance(raw, list) and all(isinstance(t, dict) for t in raw):
        return None, [(str(t.get("input", "")), str(t.get("output", ""))) for t in raw]
    if isinstance(raw, list):
        return [str(t) for t in raw if str(t).strip()], None
    return [], None


def passed(program: str, asserts: list[str] | None, io: list[tuple[str, str]] | None,
           limits: Limits) -> list[bool]:
    """Which tests the program passes, run in a limited child (see the module's docstring)."""
    n = len(asserts) if asserts is not None else len(io or [])
    if n == 0:
        return []
    home = Path(tempfile.mkdtemp(prefix="posttrain-code-"))
    read, write = os.pipe()
    mark = secrets.token_hex(16)
    memory = limits.memory_mb * 1024 * 1024
    spec = {"program": program, "asserts": asserts, "io": io, "fd": write, "mark": mark,
            "memory": memory, "fsize": 64 * 1024 * 1024, "cpu": limits.cpu_s,
            "parent": os.getpid()}
    try:
        proc = subprocess.Popen([*python_argv(), "-c", HARNESS], cwd=home, env=child_env(home),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                pass_fds=(write,))
        os.close(write)
        write = -1
        deadline = time.monotonic() + limits.timeout_s
        try:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(spec) + "\n").encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        report = _read_report(read, proc, deadline)
        kill_group(proc.pid)
        proc.wait()
    finally:
        if write >= 0:
            os.close(write)
        os.close(read)
        shutil.rmtree(home, ignore_errors=True)
    results = [False] * n
    for line in report.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == mark and parts[1].isdigit() and int(parts[1]) < n:
            results[int(parts[1])] = parts[2] == "1"
    return results


def _read_report(fd: int, proc: subprocess.Popen, deadline: float, cap: int = 1 << 20) -> str:
    """What the child writes to its report pipe until the pipe closes (the child and whatever it
    started have exited: at once, no polling), the child has exited (a process it left behind
    may hold the pipe open; what is there is read), or ``deadline``; at most ``cap`` bytes."""
    os.set_blocking(fd, False)
    chunks, size = [], 0
    while size < cap:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], min(left, 0.1))
        if not ready:
            if proc.poll() is not None:  # exited; a process it left holds the pipe
                chunks += _drain(fd)
                break
            continue
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)[:cap].decode("utf-8", "replace")


def _drain(fd: int) -> list[bytes]:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return chunks
        if not chunk:
            return chunks
        chunks.append(chunk)


def fraction_passed(completions: Sequence[str], items: Sequence[ObsBundle], *,
                    limits: Limits | None = None, all_or_nothing: bool = False) -> list[float]:
    """Each completion's score against its item's tests (``limits``: per completion)."""
    limits = limits or Limits()
    out = []
    for completion, item in zip(completions, items, strict=True):
        asserts, io = tests_of(item)
        results = passed(program_of(completion), asserts, io, limits)
        if not results:
            out.append(0.0)
        elif all_or_nothing:
            out.append(float(all(results)))
        else:
            out.append(sum(results) / len(results))
    return out


def code_tests(completions: Sequence[str], items: Sequence[ObsBundle]) -> list[float]:
    """The fraction of the item's tests the completion's program passes (default limits: 10 s,
    1024 MiB; the recipe's ``reward.sample_timeout_s`` and ``reward.memory_mb`` apply when the
    reward set is built)."""
    return fraction_passed(completions, items)


def code_tests_all(completions: Sequence[str], items: Sequence[ObsBundle]) -> list[float]:
    """1.0 when the completion's program passes every test of the item, else 0.0."""
    return fraction_passed(completions, items, all_or_nothing=True)


def code_rewards(limits: Limits) -> dict[str, Any]:
    """The code-running built-ins by name, each under ``limits`` (the recipe's
    ``reward.sample_timeout_s`` and ``reward.memory_mb``)."""
    return {"code_tests": functools.partial(fraction_passed, limits=limits),
            "code_tests_all": functools.partial(fraction_passed, limits=limits,
                                                all_or_nothing=True)}
