"""metrics.jsonl (always) and TensorBoard (when asked): one row per logged step.

Keys under ``time/`` and ``perf/`` are wall-clock measurements; everything else is a pure
function of the run's inputs, which is what the exact-resume tests compare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TIMING_PREFIXES = ("time/", "perf/")


def is_timing(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES)


class MetricsLog:
    """Appends rows to ``metrics.jsonl``; keeps them in memory for checkpoints. With no path
    (every rank but rank 0) it only keeps them."""

    def __init__(self, path: Path | None, rows: list[dict[str, Any]] | None = None,
                 tensorboard_dir: Path | None = None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = list(rows or [])
        self._tb = None
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        # Rewrite from the rows we resume with: drops rows a killed run wrote after its checkpoint.
        with open(path, "w", encoding="utf-8") as f:
            for row in self.rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                from runner.errors import Problem, RecipeError

                raise RecipeError([Problem("logging.tensorboard", "needs the tensorboard package",
                                           got=True, hint="pip install tensorboard, or set "
                                           "logging.tensorboard = false")]) from exc
            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        if self._tb is not None:
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
