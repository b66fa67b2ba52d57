"""Reward functions for the tests of where rewards run when a producer samples ahead
(``tests/test_producer_rewards.py``): one that records the thread each call ran on, a slow one,
and one for worker processes that fails from the second batch on."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

LOG = "reward-threads.txt"  # in the run's output folder: one line per call
FIRST_BATCH = 16  # samples of a test run's first batch (4 prompts x 4 completions)
_scored = 0  # samples this worker process scored


def _output_dir() -> Path:
    """The run's output folder, from its command line (``run.output_dir=...``)."""
    prefix = "run.output_dir="
    return Path(next(a[len(prefix):] for a in sys.argv if a.startswith(prefix)))


def _values(completions) -> list[float]:
    return [float(len(text) % 3) for text in completions]


def recorded(completions, items):
    """Each completion's length mod 3; appends the calling thread's name and the batch size to
    the run's ``reward-threads.txt``. (With ``reward.timeout_s = 0`` a single function runs on
    the thread that asked for the rewards.)"""
    with open(_output_dir() / LOG, "a") as f:
        f.write(f"{threading.current_thread().name} {len(completions)}\n")
    return _values(completions)


def slow(completions, items):
    """Each completion's length mod 3, after 0.3 s."""
    time.sleep(0.3)
    return _values(completions)


def fails_after_first_batch(completions, items):
    """For one worker process (``reward.workers = 1``), one sample per call: the samples of the
    first batch score their length mod 3, every later one raises."""
    global _scored
    _scored += len(completions)
    if _scored > FIRST_BATCH:
        raise ValueError(f"sample {_scored} is past the first batch")
    return _values(completions)
