"""metrics.jsonl (always) and the trackers of logging.report_to: one row per logged step.

Keys under ``time/`` and ``perf/`` are wall-clock measurements; everything else is a pure
function of the run's inputs, which is what the exact-resume tests compare.

The file is never written through a symbolic link. A write that fails (a full disk, a
read-only folder, a link in its place) raises ``RuntimeFailure`` naming the
writer's role, the step and the file. A tracker never stops the run (``runner.ui.trackers``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import RuntimeFailure
from runner.state.run_folder import no_follow

if TYPE_CHECKING:
    from runner.ui.trackers import Trackers

TIMING_PREFIXES = ("time/", "perf/")
WRITER_ROLE = "policy"  # rank 0 of the policy writes metrics (and checkpoints)


def is_timing(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES)


class MetricsLog:
    """Appends rows to ``metrics.jsonl`` and hands each to the run's trackers; keeps them in
    memory for checkpoints. With no path (every rank but rank 0) it only keeps them."""

    def __init__(self, path: Path | None, rows: list[dict[str, Any]] | None = None,
                 trackers: Trackers | None = None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = list(rows or [])
        self.trackers = trackers
        if path is None:
            return
        # Rewrite from the rows we resume with: drops rows a killed run wrote after its checkpoint.
        step = int(self.rows[-1]["step"]) if self.rows and "step" in self.rows[-1] else None
        self._append(self.rows, "w", step)

    def _append(self, rows: list[dict[str, Any]], mode: str, step: int | None) -> None:
        text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, mode, encoding="utf-8", opener=no_follow) as f:
                f.write(text)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise RuntimeFailure(WRITER_ROLE, step, f"cannot write metrics to {self.path}: "
                                 f"{reason} [errno {exc.errno}]") from exc

    def write(self, row: dict[str, Any]) -> None:
        if self.path is not None:
            step = row.get("step")
            self._append([row], "a", int(step) if isinstance(step, int) else None)
        self.rows.append(row)
        if self.trackers is not None:
            self.trackers.log(row)

    def tracker_ids(self) -> dict[str, str]:
        """The tracker run ids a checkpoint keeps, so that a resume continues those runs."""
        return dict(self.trackers.ids) if self.trackers is not None else {}

    def close(self, outcome: str = "finished") -> None:
        """``outcome``: finished, stopped (resumable) or failed, as the trackers record it."""
        if self.trackers is not None:
            self.trackers.close(outcome)
