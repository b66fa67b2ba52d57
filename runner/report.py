"""``posttrain-run report RUN_DIR [RUN_DIR ...] [--out FILE]``: one self-contained HTML file that
compares runs (no network, no scripts: inline CSS and SVG only).

It shows, for every numeric metric of ``metrics.jsonl``, one chart of its value per step with
every run overlaid (grouped by prefix: held-out evaluation, reward, loss and KL, rollout, time,
throughput, the rest); the final metrics table (each metric's last logged value per run); and
each run's resolved-recipe differences from the first run (dotted key: the first run's value ->
this run's). ``run.output_dir`` and the hash, source and overrides of the ``[resolved]`` table are
left out of the differences (they differ between any two runs); package versions are compared.

A step logged twice (an appended file) counts once: its last row wins. A metric absent from a
row has no point there (a held-out value logged every N steps is one line through its points);
a NaN or infinite value breaks the line (a gap), marked on the step axis. Every text that comes
from a run (names, metric keys, recipe values) is escaped. The file is written in place, never
through a symbolic link. Imports no torch.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from runner import __version__
from runner.errors import Problem, RecipeError, safe_line
from runner.state.run_folder import RunFolder, write_text, writing

METRICS, RESOLVED = RunFolder(Path()).metrics.name, RunFolder(Path()).resolved.name
NOT_COMPARED = frozenset({"run.output_dir", "resolved.recipe_hash", "resolved.source",
                          "resolved.overrides"})
# Tableau 10: run i draws in PALETTE[i % 10]; from the 11th run on, lines are dashed as well.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
GROUPS = {"eval": "Held-out evaluation (eval/)", "reward": "Reward (reward/)",
          "loss": "Loss and KL", "rollout": "Rollout (rollout/)",
          "time": "Time split (time/, seconds)", "perf": "Throughput (perf/)", "other": "Other"}
WIDTH, HEIGHT = 360, 220
PLOT = (58.0, 12.0, WIDTH - 12.0, HEIGHT - 30.0)  # left, top, right, bottom of the plot area
MAX_POINTS = 1200  # a longer series is thinned to the lowest and highest of each of 599 buckets


@dataclass
class Run:
    folder: Path
    name: str
    series: dict[str, list[tuple[int, float]]]  # metric -> (step, value) in step order
    recipe: dict[str, Any] = field(default_factory=dict)  # dotted key -> value
    skipped: int = 0  # lines of metrics.jsonl that are no JSON row with an integer step

    @property
    def last_step(self) -> int:
        return max(points[-1][0] for points in self.series.values())


def _refuse(what: str, hint: str = "") -> RecipeError:
    return RecipeError([Problem("", what, hint=hint, source="report")])


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise _refuse(f"{path} cannot be read: {exc.strerror or exc} [errno {exc.errno}]") from exc


def _float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        return math.inf if value > 0 else -math.inf


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_run(folder: Path) -> Run:
    """The metrics and resolved recipe of the run folder ``folder``; a folder that is no run, or
    whose metrics hold no numeric row, is refused naming it."""
    metrics, resolved = RunFolder(folder).metrics, RunFolder(folder).resolved
    if not metrics.is_file():
        what = "is not a run folder" if not resolved.is_file() else "has logged no metrics"
        raise _refuse(f"{folder} {what} (it has no {METRICS})", "give the run.output_dir of a run")
    rows: dict[int, dict[str, float]] = {}
    skipped = 0
    for line in _read(metrics).splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            row = None
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, float) and step.is_integer():
            step = int(step)
        if not isinstance(step, int) or isinstance(step, bool) or abs(step) > 2**53:
            skipped += bool(line.strip())
            continue
        rows[step] = {k: _float(v) for k, v in row.items() if k != "step" and
                      isinstance(v, int | float) and not isinstance(v, bool)}
    series: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(rows):
        for key, value in rows[step].items():
            series.setdefault(key, []).append((step, value))
    if not series:
        raise _refuse(f"{folder}: its {METRICS} holds no numeric metrics",
                      "give a run that has logged a step")
    recipe: dict[str, Any] = {}
    if resolved.is_file():
        try:
            recipe = _flatten(tomllib.loads(_read(resolved)))
        except (tomllib.TOMLDecodeError, RecursionError) as exc:
            raise _refuse(f"{resolved} is not TOML ({exc})") from exc
    name = recipe.get("run.name")
    name = name if isinstance(name, str) and name else folder.resolve().name or str(folder)
    return Run(folder, name, series, recipe, skipped)


def _unique_names(runs: list[Run]) -> None:
    """Runs that share a name get their folder's name after it, then a number."""
    for attempt in (lambda r, i: f"{r.name} [{r.folder.resolve().name}]",
                    lambda r, i: f"{r.name} #{i + 1}"):
        names = [r.name for r in runs]
        for i, run in enumerate(runs):
            if names.count(run.name) > 1:
                run.name = attempt(run, i)


def group_of(key: str) -> str:
    head = key.split("/", 1)[0] if "/" in key else ""
    if head in GROUPS:
        return head
    return "loss" if {"loss", "kl"} & set(re.split(r"[^a-z0-9]+", key.lower())) else "other"


def _nice(span: float) -> float:
    """The step of four to seven ticks over ``span``: 1, 2 or 5 times a power of ten."""
    raw = span / 6
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))


def _ticks(lo: float, hi: float, integer: bool = False) -> list[float]:
    step = max(_nice(hi - lo), 1.0) if integer else _nice(hi - lo)
    first = math.ceil(lo / step - 1e-9)
    return [t * step for t in range(first, math.floor(hi / step + 1e-9) + 1)]


def _tick_label(value: float, step: float) -> str:
    if value == 0:
        return "0"
    if not 1e-4 <= abs(step) < 1e6:
        return f"{value:.3g}"
    return f"{value:.{max(0, -math.floor(math.log10(step) + 1e-9))}f}"


def _drawable(value: float) -> bool:
    """Finite, and small enough that the span of two such values is finite too."""
    return abs(value) < 1e300


def _num(value: float) -> str:
    return f"{value:.6g}"


def _thin(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """At most ``MAX_POINTS`` points: the first, the last, and the lowest and highest of each
    of ``MAX_POINTS // 2 - 1`` buckets, in step order."""
    if len(points) <= MAX_POINTS:
        return points
    size = math.ceil(len(points) / (MAX_POINTS // 2 - 1))
    kept = {points[0], points[-1]}
    for i in range(0, len(points), size):
        bucket = points[i:i + size]
        kept |= {min(bucket, key=lambda p: p[1]), max(bucket, key=lambda p: p[1])}
    return sorted(kept)


def _chart(key: str, runs: list[Run]) -> str:
    left, top, right, bottom = PLOT
    drawn = [(i, r.series.get(key, [])) for i, r in enumerate(runs)]
    steps = [s for _, pts in drawn for s, _ in pts]
    values = [v for _, pts in drawn for _, v in pts if _drawable(v)]
    x_lo, x_hi = min(steps), max(steps)
    if x_lo == x_hi:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi = (min(values), max(values)) if values else (0.0, 1.0)
    tiny = y_hi - y_lo <= 1e-9 * max(abs(y_lo), abs(y_hi))
    pad = (abs(y_lo) * 0.1 or 1.0) if tiny else (y_hi - y_lo) * 0.05
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def x_of(step: float) -> float:
        return left + (step - x_lo) / (x_hi - x_lo) * (right - left)

    def y_of(value: float) -> float:
        return bottom - (value - y_lo) / (y_hi - y_lo) * (bottom - top)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" data-x="{x_lo!r} {x_hi!r}" data-y="{y_lo!r} {y_hi!r}" '
           f'role="img" aria-label="{escape(key)}">',
           f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
           'class="frame"/>']
    x_ticks, y_ticks = _ticks(x_lo, x_hi, integer=True), _ticks(y_lo, y_hi)
    for t in x_ticks:
        x = x_of(t)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" class="gl"/>'
                   f'<text x="{x:.1f}" y="{bottom + 14}" class="tx">{int(t)}</text>')
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    for t in y_ticks:
        y = y_of(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" class="gl"/>'
                   f'<text x="{left - 4}" y="{y + 4:.1f}" class="ty">'
                   f'{escape(_tick_label(t, y_step))}</text>')
    out.append(f'<text x="{right}" y="{HEIGHT - 2}" class="tx end">step</text>')
    if not values:
        out.append(f'<text x="{(left + right) / 2}" y="{(top + bottom) / 2}" class="tx">'
                   'no finite values</text>')
    for i, points in drawn:
        out.extend(_series(i, runs[i].name, points, x_of, y_of, bottom))
    out.append("</svg>")
    legend = "".join(
        f'<span><i style="background:{PALETTE[i % len(PALETTE)]}"></i>{escape(runs[i].name)}'
        + (f" <b>{_num(points[-1][1])}</b>" if points else " <em>(not logged)</em>") + "</span>"
        for i, points in drawn)
    return (f'<figure data-metric="{escape(key)}"><figcaption>{escape(key)}</figcaption>'
            f'{"".join(out)}<div class="legend">{legend}</div></figure>')


def _series(i: int, name: str, points: list[tuple[int, float]], x_of: Callable[[float], float],
            y_of: Callable[[float], float], bottom: float) -> list[str]:
    """Run ``i``'s line of one chart: its finite stretches as polylines (with dots when there
    are few points), a marker under each non-finite value."""
    colour, dash = PALETTE[i % len(PALETTE)], ' stroke-dasharray="6 3"' * (i >= len(PALETTE))
    label = escape(name)
    out: list[str] = []
    segments: list[list[tuple[int, float]]] = [[]]
    for step, value in points:
        if _drawable(value):
            segments[-1].append((step, value))
        else:
            segments.append([])
            out.append(f'<path d="M{x_of(step):.1f} {bottom}l-4 6h8z" fill="{colour}" '
                       f'class="nonfinite"><title>{label}: step {step}: {value}</title></path>')
    for seg in filter(None, segments):
        seg = _thin(seg)
        if len(seg) > 1:
            coords = " ".join(f"{x_of(s):.1f},{y_of(v):.1f}" for s, v in seg)
            out.append(f'<polyline points="{coords}" stroke="{colour}"{dash} class="series" '
                       f'data-run="{i}"><title>{label}</title></polyline>')
        if len(seg) == 1 or len(points) <= 40:
            out.extend(f'<circle cx="{x_of(s):.1f}" cy="{y_of(v):.1f}" r="2.5" '
                       f'fill="{colour}"><title>{label}: step {s}: {_num(v)}</title></circle>'
                       for s, v in seg)
    return out


def _show(value: Any) -> str:
    """A recipe value written as in TOML, on one escaped line."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float):
        text = repr(value)
    else:
        text = json.dumps(value, ensure_ascii=False, default=str)
    return escape(safe_line(text, 200))


def recipe_diff(first: dict[str, Any], other: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, first run's value, this run's value) for every key that differs; ``...``
    stands for a key a recipe does not have."""
    keys = sorted((first.keys() | other.keys()) - NOT_COMPARED)
    return [(k, first.get(k, ...), other.get(k, ...)) for k in keys
            if first.get(k, ...) != other.get(k, ...)
            or type(first.get(k)) is not type(other.get(k))]


def _swatch(i: int) -> str:
    return f'<i style="background:{PALETTE[i % len(PALETTE)]}"></i>'


def render(runs: list[Run]) -> str:
    """The report of ``runs`` (the first is the one the others' recipes are compared with)."""
    keys = sorted({k for r in runs for k in r.series}, key=lambda k: (list(GROUPS).index(
        group_of(k)), k))
    parts = ['<section id="runs"><h2>Runs</h2><table><tr><th>run</th><th>folder</th>'
             '<th>algorithm</th><th>model</th><th>last step</th><th>recipe hash</th></tr>']
    for i, run in enumerate(runs):
        cells = [str(run.folder), run.recipe.get("algo.kind", ""), run.recipe.get("model.path", ""),
                 run.last_step, str(run.recipe.get("resolved.recipe_hash", ""))[:12]]
        note = (f' <em>({run.skipped} unreadable lines of {METRICS} skipped)</em>'
                if run.skipped else "")
        parts.append(f"<tr><td>{_swatch(i)}{escape(run.name)}{note}</td>" + "".join(
            f"<td>{escape(safe_line(str(c), 200))}</td>" for c in cells) + "</tr>")
    parts.append("</table></section>")
    for group, title in GROUPS.items():
        charts = [_chart(k, runs) for k in keys if group_of(k) == group]
        if charts:
            parts.append(f'<section class="group" id="g-{group}"><h2>{escape(title)}</h2>'
                         f'<div class="charts">{"".join(charts)}</div></section>')
    parts.append('<section id="final"><h2>Final metrics</h2><p>The last value logged of each '
                 'metric, with its step where that is not the run\'s last.</p><table><tr>'
                 '<th>metric</th>' + "".join(f"<th>{_swatch(i)}{escape(r.name)}</th>"
                                             for i, r in enumerate(runs)) + "</tr>")
    for key in keys:
        cells = []
        for run in runs:
            points = run.series.get(key)
            at = f' <em>@{points[-1][0]}</em>' if points and points[-1][0] != run.last_step else ""
            cells.append(f"<td>{_num(points[-1][1])}{at}</td>" if points else "<td>-</td>")
        parts.append(f"<tr><td>{escape(key)}</td>{''.join(cells)}</tr>")
    parts.append(f'</table></section><section id="recipe"><h2>Recipe differences from '
                 f'{escape(runs[0].name)}</h2>')
    for i, run in enumerate(runs[1:], 1):
        rows = recipe_diff(runs[0].recipe, run.recipe)
        parts.append(f'<h3>{_swatch(i)}{escape(run.name)}</h3>')
        if not run.recipe or not runs[0].recipe:
            parts.append(f"<p>Not compared: a run has no {RESOLVED}.</p>")
        elif not rows:
            parts.append("<p>The same resolved recipe.</p>")
        else:
            parts.append(f'<table class="diff"><tr><th>key</th><th>{escape(runs[0].name)}</th>'
                         f"<th>{escape(run.name)}</th></tr>" + "".join(
                             f"<tr><td>{escape(k)}</td>"
                             + "".join("<td><em>(absent)</em></td>" if v is ... else
                                       f"<td>{_show(v)}</td>" for v in (a, b)) + "</tr>"
                             for k, a, b in rows) + "</table>")
    if len(runs) == 1:
        parts.append("<p>One run: nothing to compare.</p>")
    title = escape(safe_line("report: " + ", ".join(r.name for r in runs), 200))
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f'<style>{CSS}</style></head><body><h1>Run report</h1><p class="meta">{len(runs)} '
            f'run{"s" * (len(runs) != 1)}, {len(keys)} metrics; written by posttrain-run '
            f'{escape(__version__)}.</p>'
            + "".join(parts) + "</section></body></html>\n")


CSS = (
    "body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fff}"
    "h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:20px 0 8px;border-bottom:1px "
    "solid #ddd}h3{font-size:15px;margin:12px 0 4px}.meta{color:#666;margin:0}"
    "table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;"
    "font-variant-numeric:tabular-nums}th{background:#f4f4f4}em{color:#888}"
    "i{display:inline-block;width:14px;height:3px;margin:0 6px 4px 0;vertical-align:middle}"
    ".charts{display:flex;flex-wrap:wrap;gap:10px}figure{margin:0;padding:6px;border:1px solid "
    "#e4e4e4;border-radius:4px;width:362px}figcaption{font-weight:600;font-size:13px;"
    "overflow-wrap:anywhere}.legend{font-size:12px;display:flex;flex-wrap:wrap;gap:2px 12px;"
    "overflow-wrap:anywhere}.frame{fill:none;stroke:#bbb}.gl{stroke:#eee}"
    ".series{fill:none;stroke-width:2;stroke-linejoin:round;stroke-linecap:round}"
    "text{font:11px system-ui,sans-serif;fill:#555}.tx{text-anchor:middle}.ty{text-anchor:end}"
    ".end{text-anchor:end}")


def report(run_dirs: list[Path], out: Path | None = None) -> tuple[Path, int, int]:
    """Write the report of ``run_dirs`` to ``out`` (default: ``report.html`` in the first run's
    folder); returns the path, the number of runs and of metrics."""
    runs = [load_run(folder) for folder in run_dirs]
    _unique_names(runs)
    out = out if out is not None else RunFolder(run_dirs[0]).report
    text = render(runs)
    with writing("the report", out, role="report"):
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text(out, text)
    return out, len(runs), len({k for r in runs for k in r.series})
