"""One reward worker process of ``reward.isolation = "process"`` (started by
``runner.rewards.pool``; ``python -m runner.rewards.worker CMD_FD RESULT_FD``).

It reads its set-up, then one task at a time, each a JSON line from the trainer, and answers
each on its result pipe with one JSON line. An item arrives as an ``ObsBundle`` of its prompt,
reference, id and metadata (no images or videos). A task is one sample: the named reward
function called on a one-element batch, in a fresh temporary working folder (deleted
afterwards), with the sample's address-space and CPU limits set and its stdout/stderr captured
(a capped tail comes back with an error). A watchdog ends the worker, and everything it
started, when the trainer is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from runner.rewards.sandbox import OUTPUT_CAP, Limits, lift_limits, limit_self
from runner.types import ObsBundle


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    os.killpg(0, 9)  # the trainer is gone: this worker and whatever it started


def _functions(specs: dict[str, str], limits: Limits) -> dict[str, Any]:
    from runner.extensions import load_callable
    from runner.rewards.builtin import BUILTIN_REWARDS
    from runner.rewards.code_tests import code_rewards

    sandboxed = code_rewards(limits)
    return {name: sandboxed.get(spec) or BUILTIN_REWARDS.get(spec) or load_callable(spec)
            for name, spec in specs.items()}


def _capture() -> tuple[int, int, str]:
    """Point fds 1 and 2 at a fresh file; (saved 1, saved 2, the file)."""
    fd, path = tempfile.mkstemp(prefix="output-")
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return saved[0], saved[1], path


def _release(saved_out: int, saved_err: int, path: str) -> str:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(saved_out, 1)
    os.dup2(saved_err, 2)
    os.close(saved_out)
    os.close(saved_err)
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - OUTPUT_CAP))
        return f.read().decode("utf-8", "replace")


def _one(fn: Any, completion: str, item: Any, limits: Limits) -> dict[str, Any]:
    home = tempfile.mkdtemp(prefix="sample-")
    before = os.getcwd()
    os.chdir(home)
    out = _capture()
    answer: dict[str, Any]
    try:
        limit_self(limits)
        value = list(fn([completion], [item]))
        if len(value) != 1:
            answer = {"error": f"returned {len(value)} values for 1 completion"}
        else:
            answer = {"value": float(value[0])}
    except BaseException as exc:  # noqa: BLE001 - anything the reward raises, even SystemExit
        answer = {"error": f"raised {type(exc).__name__}: {exc}"}
    finally:
        lift_limits()
        answer["output"] = _release(*out)
        os.chdir(before)
        shutil.rmtree(home, ignore_errors=True)
    return answer


def main(cmd_fd: int, result_fd: int) -> None:
    commands = os.fdopen(cmd_fd, "r", encoding="utf-8")
    results = os.fdopen(result_fd, "w")
    setup = json.loads(commands.readline())
    threading.Thread(target=_watch, args=(setup["parent"],), daemon=True).start()
    limits = Limits(*setup["limits"])
    functions = _functions(setup["functions"], limits)
    results.write(json.dumps({"ready": True}) + "\n")
    results.flush()
    while True:
        line = commands.readline()
        if not line:
            return
        task_id, name, completion, raw = json.loads(line)
        item = ObsBundle(raw["prompt"], raw["reference"], id=raw["id"], metadata=raw["metadata"])
        answer = _one(functions[name], completion, item, limits)
        answer["id"] = task_id
        try:
            results.write(json.dumps(answer, allow_nan=True) + "\n")
        except ValueError:
            results.write(json.dumps({"id": task_id, "error": "returned a value that is not "
                                      "JSON"}) + "\n")
        results.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
