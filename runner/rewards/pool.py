"""The reward workers of ``reward.isolation = "process"``: processes the runner starts and owns,
each scoring one sample at a time (``runner.rewards.worker``).

A worker runs in its own session with an environment that holds none of the trainer's variables
(``runner.rewards.sandbox``). A sample past ``reward.sample_timeout_s``, a worker that dies
(a signal, ``os._exit``, a crash, the memory limit) or leaves processes behind is killed with
everything it started and replaced; that sample failed, and the caller decides what a failure
costs (``reward.on_error``). Workers end with the pool, and on their own within a fraction of a
second when the trainer is gone (even SIGKILLed).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from runner.errors import RewardFailure
from runner.rewards.calls import not_a_reward
from runner.rewards.sandbox import Limits, child_env, group_members, kill_group


def item_record(item: Any) -> dict[str, Any]:
    """What a worker receives of an item: its text fields and metadata (JSON); images and
    videos stay in the trainer."""
    return {"prompt": item.prompt, "reference": item.reference, "id": item.id,
            "metadata": item.metadata}


START_TIMEOUT_S = 120.0  # a worker imports the reward functions' modules before it is ready
STARTS_IN_A_ROW = 3  # workers that die before answering once, in a row: the pool gives up


@attrs.frozen
class Failed:
    """One sample that has no value: which function, which sample, what happened."""

    name: str
    index: int
    what: str


class _Worker:
    def __init__(self, specs: dict[str, str], limits: Limits) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="posttrain-reward-"))
        cmd_r, self.cmd = os.pipe()
        self.res, res_w = os.pipe()
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self.log = open(self.home / ".worker.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runner.rewards.worker", str(cmd_r), str(res_w)],
            cwd=self.home, env=child_env(self.home, {"PYTHONPATH": path}),
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            start_new_session=True, pass_fds=(cmd_r, res_w))
        os.close(cmd_r)
        os.close(res_w)
        self.buffer = b""
        self.answered = False
        self.started = time.monotonic()
        self.send({"functions": specs, "limits": (limits.timeout_s, limits.memory_mb),
                   "parent": os.getpid()})

    def send(self, message: Any) -> None:
        data = (json.dumps(message, allow_nan=True) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.cmd, view):]

    def lines(self) -> list[dict[str, Any]] | None:
        """The answers that arrived (None: the worker's pipe closed, it is gone)."""
        chunk = os.read(self.res, 1 << 20)
        if not chunk:
            return None
        self.buffer += chunk
        *done, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in done if line.strip()]

    def strays(self) -> bool:
        """Whether processes it started are still running after its sample."""
        return any(pid != self.proc.pid for pid in group_members(self.proc.pid))

    def end(self, closed: bool = False) -> str:
        """Kill it and everything it started; what became of it. ``closed``: its pipe closed,
        so it is ending on its own (a moment is given for its exit code)."""
        if closed:
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc.pid)
        code = self.proc.wait()
        for fd in (self.cmd, self.res):
            try:
                os.close(fd)
            except OSError:
                pass
        self.log.close()
        tail = (self.home / ".worker.log").read_bytes()[-400:].decode("utf-8", "replace")
        shutil.rmtree(self.home, ignore_errors=True)
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and
               -code in signal.valid_signals() else f"exited with code {code}")
        return how + (f" ({tail.strip().splitlines()[-1]})" if tail.strip() else "")


class RewardPool:
    """``workers`` reward workers for the functions ``specs`` (name -> built-in name or dotted
    path), each sample under ``limits``."""

    def __init__(self, specs: dict[str, str], workers: int, limits: Limits) -> None:
        self.specs, self.size, self.limits = dict(specs), max(1, workers), limits
        self.workers: list[_Worker] = []
        self.died_starting = 0
        self._lock = threading.Lock()  # one batch at a time, whichever thread asks
        atexit.register(self.close)

    def close(self) -> None:
        with self._lock:
            while self.workers:
                self.workers.pop().end()

    def _start(self) -> _Worker:
        worker = _Worker(self.specs, self.limits)
        self.workers.append(worker)
        return worker

    def _replace(self, worker: _Worker, closed: bool = False) -> str:
        self.workers.remove(worker)
        what = worker.end(closed)
        if not worker.answered:
            self.died_starting += 1
            if self.died_starting >= STARTS_IN_A_ROW:
                raise RewardFailure(None, [("the reward workers", None, "cannot start: "
                                            f"{STARTS_IN_A_ROW} in a row {what}")])
        return what

    def score(self, names: Sequence[str], completions: Sequence[str], items: Sequence[Any]
              ) -> tuple[dict[str, list[float | None]], list[Failed]]:
        """Every function's value for every sample (None where it failed) and the failures."""
        with self._lock:
            return self._score(names, completions, items)

    def _score(self, names: Sequence[str], completions: Sequence[str], items: Sequence[Any]
               ) -> tuple[dict[str, list[float | None]], list[Failed]]:
        n = len(completions)
        values: dict[str, list[float | None]] = {name: [None] * n for name in names}
        failed: list[Failed] = []
        todo = collections.deque((name, i) for name in names for i in range(n))
        while len(self.workers) < min(self.size, max(1, len(todo))):
            self._start()
        busy: dict[_Worker, tuple[tuple[str, int], float]] = {}
        ready = {w for w in self.workers if w.answered}
        with selectors.DefaultSelector() as sel:
            for w in self.workers:
                sel.register(w.res, selectors.EVENT_READ, w)
            while todo or busy:
                for w in [w for w in self.workers if w in ready and w not in busy]:
                    if not todo:
                        break
                    task = todo.popleft()
                    try:
                        w.send([task[1], task[0], completions[task[1]],
                                item_record(items[task[1]])])
                    except BrokenPipeError:
                        todo.appendleft(task)
                        ready.discard(w)
                        continue  # its death is read from its result pipe
                    busy[w] = (task, time.monotonic() + self.limits.timeout_s)
                self._wait(sel, busy, ready, values, failed, todo)
        return values, failed

    def _wait(self, sel: selectors.BaseSelector, busy: dict[_Worker, tuple[tuple[str, int], float]],
              ready: set[_Worker], values: dict[str, list[float | None]], failed: list[Failed],
              todo: collections.deque[tuple[str, int]]) -> None:
        """Wait for answers (or a deadline); replace the workers that died or overran."""
        now = time.monotonic()
        deadlines = [d for _, d in busy.values()] or [now + START_TIMEOUT_S]
        for key, _ in sel.select(max(0.0, min(deadlines) - now)):
            w: _Worker = key.data
            answers = w.lines()
            if answers is None:
                sel.unregister(w.res)
                what = self._replace(w, closed=True)
                if w in busy:
                    (name, i), _ = busy.pop(w)
                    failed.append(Failed(name, i, f"its worker {what}"))
                self._respawn(sel, ready)
                continue
            for answer in answers:
                w.answered = True
                self.died_starting = 0
                ready.add(w)
                if "ready" in answer or w not in busy:
                    continue
                (name, i), _ = busy.pop(w)
                why = not_a_reward(answer["value"]) if "value" in answer else ""
                if "value" in answer and not why:
                    values[name][i] = answer["value"]
                elif why:
                    failed.append(Failed(name, i, f"returned {answer['value']!r}: {why}"))
                else:
                    failed.append(Failed(name, i, answer.get("error", "failed")))
                if w.strays():  # it left processes behind: a fresh worker for the next sample
                    sel.unregister(w.res)
                    self._replace(w)
                    self._respawn(sel, ready)
        now = time.monotonic()
        for w in [w for w in self.workers if not w.answered
                  and now - w.started > START_TIMEOUT_S]:
            sel.unregister(w.res)
            self._replace(w)
            self._respawn(sel, ready)
        for w, ((name, i), deadline) in list(busy.items()):
            if now >= deadline:
                busy.pop(w)
                sel.unregister(w.res)
                self._replace(w)
                failed.append(Failed(name, i, "ran past reward.sample_timeout_s = "
                                     f"{self.limits.timeout_s:g} s; its worker was killed"))
                self._respawn(sel, ready)

    def _respawn(self, sel: selectors.BaseSelector, ready: set[_Worker]) -> None:
        while len(self.workers) < self.size:
            w = self._start()
            sel.register(w.res, selectors.EVENT_READ, w)
