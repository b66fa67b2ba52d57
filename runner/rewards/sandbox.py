"""Running code the runner does not trust (a reward's worker, a model's program) in a child
process with limits: an address-space limit (``RLIMIT_AS``), a CPU-time limit, no core files,
a bound on the files it writes, its own session (so it and everything it forks are killed
together), a fresh temporary working directory deleted afterwards, closed stdin, an environment
holding no variable of the trainer's (no API keys, no tracker tokens), and its output captured
up to a size.

What this is: a boundary for resources and crashes. A program that loops, allocates without
end, forks, segfaults or calls ``os._exit`` costs its own process and nothing else. What it is
not: a security boundary. The child runs as the same user, can read what that user can read and
open network connections (no namespaces are set up: they need privileges these machines may not
grant), and code that sets out to forge its result can find ways to. Run untrusted code from
outside the model's own outputs in a container or a VM.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from pathlib import Path

import attrs

OUTPUT_CAP = 64 * 1024  # bytes of a child's stdout and of its stderr kept
FILE_CAP = 64 * 1024 * 1024  # bytes one file written by the child may reach (RLIMIT_FSIZE)
# What the child's environment holds: no variable of the trainer's, only these.
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


@attrs.frozen
class Limits:
    """What one sample may use: wall-clock seconds, address space, CPU seconds."""

    timeout_s: float = 10.0
    memory_mb: int = 1024

    @property
    def cpu_s(self) -> int:
        return max(1, int(self.timeout_s) + 1)


def child_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The child's whole environment: ``SAFE_ENV``, its home and temp folder, ``extra``."""
    return {**SAFE_ENV, "HOME": str(home), "TMPDIR": str(home), **(extra or {})}


def limit_self(limits: Limits, cpu: bool = True) -> None:
    """Apply ``limits`` to this process: a child does so before it runs anything it was given
    (no ``preexec_fn``: the trainer has threads, and forking one is not safe to run Python in).
    Only soft limits are set, so a pool worker can lift them after each sample."""
    _soft(resource.RLIMIT_AS, limits.memory_mb * 1024 * 1024)
    _soft(resource.RLIMIT_CORE, 0)
    _soft(resource.RLIMIT_FSIZE, FILE_CAP)
    if cpu:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _soft(resource.RLIMIT_CPU, int(usage.ru_utime + usage.ru_stime) + limits.cpu_s)


def lift_limits() -> None:
    """Soft limits back to the hard ones (a pool worker, between samples)."""
    for which in (resource.RLIMIT_AS, resource.RLIMIT_FSIZE, resource.RLIMIT_CPU):
        hard = resource.getrlimit(which)[1]
        resource.setrlimit(which, (hard, hard))


def _soft(which: int, value: int) -> None:
    hard = resource.getrlimit(which)[1]
    resource.setrlimit(which, (value if hard == resource.RLIM_INFINITY else min(value, hard),
                               hard))


def kill_group(pid: int, rounds: int = 100) -> None:
    """SIGKILL the session ``pid`` leads: it and every process it started (they share its
    process group unless they left it), again until none is left, so that processes forked
    while the first signal went out (a fork bomb) are caught too."""
    for _ in range(rounds):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not group_members(pid):
            return
        time.sleep(0.01)


def group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def python_argv() -> list[str]:
    """This interpreter, isolated from the user's site and environment (``-I``)."""
    return [sys.executable, "-I"]
