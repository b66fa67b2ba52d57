"""One warm interpreter that forks the ranks of a torchrun job (``runner.launch.torchrun``).

Starting Python and importing torch, transformers and this package's training modules is most
of a small rank's start: about 3 s of CPU per rank on a 2-core machine, paid by every rank at
the same moment. The launcher starts this process once instead; it imports those modules
(``PRELOAD``), forks one process per rank and exits. Each rank then runs exactly what
``python -m runner.launch.worker PAYLOAD`` runs, in a session of its own, with the environment
and working directory the launcher gave it. The driver is a child subreaper, so the ranks
become its children when this process exits; it watches them as before (exit codes, signals,
death with the driver).

Only libraries are loaded before the fork: no CUDA context, no run file, no Python thread (a
preload that started one makes this process refuse to fork, and the launcher starts the ranks
the ordinary way). ``POSTTRAIN_RANK_START=spawn`` starts every rank the ordinary way too.

Protocol: ``python -m runner.launch.zygote FD``; stdin carries one JSON object ``{"payload":
path, "cwd": dir, "driver": pid, "envs": [env of rank 0, ...]}``; the rank pids, one JSON list,
are written to file descriptor FD, which is closed when this process exits.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

PRELOAD = ("torch", "transformers", "accelerate", "runner.launch.worker",
           "runner.train.assembly.assemble")
ADOPTION_S = 30.0  # how long a rank waits to become the driver's child


def rank(payload: str, cwd: str, env: dict[str, str], driver: int) -> None:
    """In a forked child: become rank ``env["RANK"]`` and run it; never returns."""
    code = 1
    try:
        os.setsid()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        deadline = time.monotonic() + ADOPTION_S
        while os.getppid() != driver:  # until this process (the parent) has exited
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.002)
        from runner.launch.rank import leave
        from runner.launch.worker import main

        sys.argv = [sys.argv[0], payload]
        leave(main([payload]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a rank's start failed: say why, then exit
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(argv: list[str]) -> int:
    report = int(argv[0])
    job: dict[str, Any] = json.loads(sys.stdin.read())
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        print(f"posttrain-run: {threading.active_count()} threads after the preload; the ranks "
              "start the ordinary way", file=sys.stderr)
        return 3
    pids = []
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        for env in job["envs"]:
            pid = os.fork()
            if pid == 0:
                os.close(report)
                rank(job["payload"], job["cwd"], env, int(job["driver"]))
            pids.append(pid)
    except OSError:  # not every rank: none runs (the launcher then starts them afresh)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        raise
    with os.fdopen(report, "w") as out:
        out.write(json.dumps(pids))
    return 0


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))
