"""What the user sees while a run works: a rich live view on a terminal, plain lines elsewhere.

Both reporters take the same calls; the training loops never print themselves. A reporter is a
context manager: leaving the block by any path (the end, an exception, Ctrl-C) tears the live
view down, so whatever is printed next (the summary, an error) lands on a clean terminal:

    with make_reporter(plain) as reporter:
        ...
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

# (metric key, label) shown in the live view and the plain lines, when the algorithm logs them.
SHOWN = (
    ("reward/mean", "reward"), ("reward/max", "reward max"), ("eval/reward", "held-out reward"),
    ("eval/preference_accuracy", "held-out pref acc"), ("eval/reverse_kl_exact", "held-out kl"),
    ("loss", "loss"), ("kl", "kl"),
    ("reverse_kl", "reverse kl"), ("accuracy", "pref acc"), ("reward_margin", "margin"),
    ("value_loss", "value loss"), ("clip_frac", "clip frac"),
    ("rollout/staleness_max", "staleness"),
    ("env/turns", "turns"), ("env/tool_calls", "tool calls"), ("env/truncated", "truncated"),
    ("perf/rollout_tok_s", "rollout tok/s"), ("perf/train_tok_s", "train tok/s"),
)
SPLIT = ("time/rollout", "time/reward", "time/update", "time/sync")


class Reporter(Protocol):
    def start(self, title: str, total: int, done: int) -> None: ...
    def step(self, step: int, metrics: dict[str, Any]) -> None: ...
    def sample(self, step: int, prompt: str, completion: str, reward: float | None) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, rows: list[tuple[str, str]]) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Reporter: ...
    def __exit__(self, *exc: object) -> None: ...


class _Closing:
    """``with reporter:`` calls ``close()`` on the way out, whatever the way out is."""

    def close(self) -> None:
        return None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def make_reporter(plain: bool) -> Reporter:
    return PlainReporter() if plain or not sys.stdout.isatty() else RichReporter()


class PlainReporter(_Closing):
    """One line per step: for logs, pipes and CI."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.total = 0

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, title: str, total: int, done: int) -> None:
        self.total = total
        self._print(f"{title}: steps {done + 1}..{total}")

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        parts = [f"{label}={_fmt(metrics[k])}" for k, label in SHOWN if k in metrics]
        self._print(f"step {step}/{self.total} " + " ".join(p.replace(" ", "_", 1) for p in parts))

    def sample(self, step: int, prompt: str, completion: str, reward: float | None) -> None:
        extra = f" (reward {reward:g})" if reward is not None else ""
        self._print(f"sample {step}: {prompt!r} -> {completion!r}{extra}")

    def message(self, text: str) -> None:
        self._print(text)

    def finish(self, rows: list[tuple[str, str]]) -> None:
        for key, value in rows:
            self._print(f"{key}: {value}")


class RichReporter(_Closing):
    """A live view: progress with ETA, the latest metrics, the time split and a sample."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"),
                                 TimeRemainingColumn(), console=self.console)
        self.metrics: dict[str, Any] = {}
        self.last_sample: tuple[int, str, str, float | None] | None = None
        self.live: Live | None = None
        self.task = None
        self.started = time.monotonic()

    def _view(self) -> Group:
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="cyan")
        table.add_column(justify="right")
        for key, label in SHOWN:
            if key in self.metrics:
                table.add_row(label, _fmt(self.metrics[key]))
        total = sum(self.metrics.get(k, 0.0) for k in SPLIT) or 1.0
        split = "  ".join(f"{k.split('/')[1]} {100 * self.metrics.get(k, 0.0) / total:.0f}%"
                          for k in SPLIT if k in self.metrics)
        parts: list[Any] = [self.progress, table]
        if split:
            parts.append(f"[dim]time split: {split}[/dim]")
        if self.last_sample:
            step, prompt, completion, reward = self.last_sample
            tail = f"   [dim](reward {reward:g})[/dim]" if reward is not None else ""
            parts.append(Panel(f"{prompt}\n[green]{completion}[/green]{tail}",
                               title=f"sample at step {step}", expand=False))
        return Group(*parts)

    def start(self, title: str, total: int, done: int) -> None:
        self.task = self.progress.add_task(title, total=total, completed=done)
        self.close()  # a second start replaces the view, never leaves one running
        self.live = Live(self._view(), console=self.console, refresh_per_second=4)
        self.live.start()

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.update(metrics)
        self.progress.update(self.task, completed=step)
        if self.live:
            self.live.update(self._view())

    def sample(self, step: int, prompt: str, completion: str, reward: float | None) -> None:
        self.last_sample = (step, prompt, completion, reward)
        if self.live:
            self.live.update(self._view())

    def message(self, text: str) -> None:
        self.console.print(text)

    def close(self) -> None:
        """Stop the live view (and its refresh thread); safe to call more than once."""
        live, self.live = self.live, None
        if live is not None:
            live.stop()

    def finish(self, rows: list[tuple[str, str]]) -> None:
        self.close()
        table = Table(title="Summary", show_header=False, title_justify="left")
        table.add_column(style="bold cyan")
        table.add_column()
        for key, value in rows:
            table.add_row(key, value)
        self.console.print(table)


class SilentReporter(_Closing):
    """The reporter of every rank but rank 0: rank 0 alone shows progress."""

    def start(self, title: str, total: int, done: int) -> None:
        pass

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def sample(self, step: int, prompt: str, completion: str, reward: float | None) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def finish(self, rows: list[tuple[str, str]]) -> None:
        pass
