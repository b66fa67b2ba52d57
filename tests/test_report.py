"""``posttrain-run report``: one self-contained HTML file comparing runs. The page is read back
with an HTML parser: a chart per numeric metric whose polylines are the data scaled to its axes
(NaN and inf break a line), the final values are the last rows', the recipe differences are
exactly the changed keys, and text from a run is escaped. Refusals are one line (exit 2). A
headless browser draws the page: its screenshot holds each run's line in the run's colour."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from runner import report
from runner.cli import main
from runner.recipe import load_recipe
from runner.recipe.resolved import write_resolved
from tests.conftest import REPO

NAN, INF = float("nan"), float("inf")


def make_run(folder: Path, rows: list[dict], *overrides: str, extra_lines: str = "") -> Path:
    """A run folder as a run leaves it: metrics.jsonl and the resolved recipe (the project's
    writer, from the GRPO recipe with ``overrides``)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (folder / "metrics.jsonl").write_text(text + extra_lines)
    recipe = load_recipe(REPO / "recipes" / "grpo-arith.toml",
                         [f"run.output_dir={folder}", *overrides])
    write_resolved(recipe, folder / "recipe.resolved.toml")
    return folder


class Page(HTMLParser):
    """The report's charts (by metric), tables (by section and heading) and text."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.figures: dict[str, dict] = {}
        self.sections: list[str] = []
        self.tags: set[str] = set()
        self.attributes: set[str] = set()
        self.tables: dict[tuple[str, str], list[list[str]]] = {}
        self._figure = self._cell = self._h3 = None
        self._row: list[str] = []
        self._heading = ""
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        self.attributes.update(a)
        if tag == "section":
            self.sections.append(a.get("id", ""))
            self._heading = ""
        elif tag == "figure":
            self._figure = self.figures.setdefault(a["data-metric"], {
                "lines": [], "dots": [], "nonfinite": [], "text": "", "legend": ""})
        elif self._figure is not None and tag in ("svg", "polyline", "circle", "path"):
            if tag == "svg":
                self._figure["svg"] = a
            elif tag == "path" and "nonfinite" in a.get("class", ""):
                self._figure["nonfinite"].append(a)
            else:
                self._figure["lines" if tag == "polyline" else "dots"].append(a)
        elif tag == "h3":
            self._h3 = ""
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag == "figure":
            self._figure = None
        elif tag == "h3":
            self._heading, self._h3 = self._h3, None
        elif tag in ("td", "th"):
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr":
            self.tables.setdefault((self.sections[-1], self._heading), []).append(self._row)

    def handle_data(self, data):
        for name in ("_cell", "_h3"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name) + data)
        if self._figure is not None:
            self._figure["text"] += data


def scaled(svg: dict, step: float, value: float) -> tuple[float, float]:
    """Where (step, value) belongs in a chart with the axes its svg element names."""
    left, top, right, bottom = report.PLOT
    (x_lo, x_hi), (y_lo, y_hi) = (map(float, svg[k].split()) for k in ("data-x", "data-y"))
    return (left + (step - x_lo) / (x_hi - x_lo) * (right - left),
            bottom - (value - y_lo) / (y_hi - y_lo) * (bottom - top))


def points(polyline: dict) -> list[float]:
    """The x, y, x, y ... of a polyline."""
    return [float(c) for p in polyline["points"].split() for c in p.split(",")]


def at(svg: dict, data: list[tuple[float, float]]) -> list[float]:
    """``points`` of the data, scaled, to the written precision (0.1 px)."""
    return pytest.approx([c for s, v in data for c in scaled(svg, s, v)], abs=0.051)


ROWS_A = [{"step": 0, "eval/reward": 0.25},
          *({"step": s, "loss": 1 / s, "reward/mean": 0.1 * s, "kl": 0.01 * s, "time/step": 0.5,
             "rollout/staleness_max": s % 2, "data/item_ids": [s, s + 1], "flag": True,
             **({"eval/reward": 0.25 + 0.05 * s} if s % 3 == 0 else {})} for s in range(1, 7)),
          {"step": 4, "loss": 0.125, "reward/mean": 0.4, "kl": 0.04, "time/step": 0.5,
           "rollout/staleness_max": 0}]  # step 4 again: this row wins
ROWS_B = [{"step": s, "loss": NAN if s == 3 else 2 / s, "reward/mean": 0.05 * s,
           "perf/train_tok_s": 100.0 * s, "grad_norm": INF if s == 5 else NAN}
          for s in range(1, 6)]


@pytest.fixture
def runs(tmp_path):
    a = make_run(tmp_path / "a", ROWS_A, "run.name=alpha", "train.lr=3e-4",
                 extra_lines="not json\n{\"step\": \"x\"}\n{\"step\": 7, \"loss\": 0.1")
    b = make_run(tmp_path / "b", ROWS_B, "run.name=beta", "train.lr=1e-3", "algo.group_size=4")
    return a, b


def test_a_chart_per_metric_with_the_data_scaled_the_final_values_and_the_diff(runs, capsys):
    a, b = runs
    assert main(["report", str(a), str(b)]) == 0
    out = a / "report.html"
    assert capsys.readouterr().out == f"wrote {out} (2 runs, 8 metrics)\n"
    page = Page(out.read_text())
    series = {0: report.load_run(a).series, 1: report.load_run(b).series}
    assert series[0]["loss"][3] == (4, 0.125)  # the last row of a step wins; the torn line is out
    keys = {"eval/reward", "loss", "reward/mean", "kl", "time/step", "rollout/staleness_max",
            "perf/train_tok_s", "grad_norm"}
    assert set(page.figures) == keys  # lists (data/item_ids) and booleans are no metrics
    # groups in order: held-out, reward, loss and KL, rollout, time, throughput, other
    assert page.sections == ["runs", "g-eval", "g-reward", "g-loss", "g-rollout", "g-time",
                             "g-perf", "g-other", "final", "recipe"]
    for key, fig in page.figures.items():
        data = [p for run in series.values() for p in run.get(key, [])]
        finite = [v for _, v in data if math.isfinite(v)] or [0.5]
        (x_lo, x_hi), (y_lo, y_hi) = (map(float, fig["svg"][k].split())
                                      for k in ("data-x", "data-y"))
        assert (x_lo, x_hi) == (min(s for s, _ in data), max(s for s, _ in data)), key
        assert y_lo < min(finite) <= max(finite) < y_hi, key
        lines = {int(line["data-run"]): [] for line in fig["lines"]}
        for line in fig["lines"]:
            lines[int(line["data-run"])].append(points(line))
        for run, drawn in lines.items():
            data = series[run][key]
            segments = [[]]
            for step, value in data:
                segments[-1].append((step, value)) if math.isfinite(value) else segments.append([])
            assert drawn == [at(fig["svg"], seg) for seg in segments if len(seg) > 1], key
    # NaN at step 3 splits beta's loss into two lines and is marked on the axis
    assert [int(line["data-run"]) for line in page.figures["loss"]["lines"]] == [0, 1, 1]
    assert len(page.figures["loss"]["nonfinite"]) == 1
    assert "no finite values" in page.figures["grad_norm"]["text"]
    assert len(page.figures["grad_norm"]["nonfinite"]) == 5
    # the held-out line goes through the steps it was logged at (0, 3, 6), not only gaps
    held_out = page.figures["eval/reward"]
    assert points(held_out["lines"][0]) == at(held_out["svg"], [(0, 0.25), (3, 0.4), (6, 0.55)])
    final = page.tables[("final", "")]
    assert final[0] == ["metric", "alpha", "beta"]
    table = {row[0]: row[1:] for row in final[1:]}
    assert set(table) == keys
    assert table["loss"] == ["0.166667", "0.4"]
    assert table["eval/reward"] == ["0.55", "-"]
    assert table["grad_norm"] == ["-", "inf"]
    assert table["perf/train_tok_s"] == ["-", "500"]
    diff = page.tables[("recipe", "beta")]
    assert diff[0] == ["key", "alpha", "beta"]
    assert {row[0]: row[1:] for row in diff[1:]} == {
        "algo.group_size": ["8", "4"], "train.lr": ["0.0003", "0.001"],
        "run.name": ['"alpha"', '"beta"']}
    assert "3 unreadable lines of metrics.jsonl skipped" in out.read_text()


def test_the_page_is_self_contained_and_text_from_a_run_is_escaped(tmp_path):
    evil = '<script>alert("x")</script>'
    a = make_run(tmp_path / "a", [{"step": 1, "loss": 1.0}])
    b = make_run(tmp_path / "b", [{"step": 1, "loss": 2.0, '<b onclick="x">m</b>': 1.0}],
                 f"run.name='{evil}'", "data.prompt_column='</td><img src=x onerror=y>'")
    out = tmp_path / "r.html"
    report.report([a, b], out)
    text = out.read_text()
    assert "<script" not in text and "<img" not in text and "<b onclick" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    assert "@import" not in text and "url(" not in text
    assert text.count("http") == text.count('xmlns="http://www.w3.org/2000/svg"')
    page = Page(text)
    assert page.tags <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p",
                         "section", "table", "tr", "th", "td", "i", "b", "em", "div", "span",
                         "figure", "figcaption", "svg", "rect", "line", "text", "polyline",
                         "circle", "path"}
    assert not page.attributes & {"src", "href", "onclick", "onerror"}
    assert '<b onclick="x">m</b>' in page.figures
    diff = {row[0]: row[1:] for row in page.tables[("recipe", evil)][1:]}
    assert diff["data.prompt_column"] == ['"prompt"', '"</td><img src=x onerror=y>"']
    assert diff["run.name"] == ['"grpo-arith"', json.dumps(evil)]


def test_runs_of_one_name_are_told_apart_and_one_run_alone_is_fine(tmp_path):
    rows = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    a, b = make_run(tmp_path / "x", rows), make_run(tmp_path / "y", rows)
    runs = [report.load_run(f) for f in (a, a, b)]
    report._unique_names(runs)
    page = Page(report.render(runs))
    assert page.tables[("final", "")][0] == [
        "metric", "grpo-arith [x] #1", "grpo-arith [x] #2", "grpo-arith [y]"]
    assert "The same resolved recipe." in report.report([a, b], tmp_path / "2.html")[0].read_text()
    solo = report.report([a], tmp_path / "1.html")
    assert solo[1:] == (1, 1) and "One run: nothing to compare." in solo[0].read_text()


def test_a_folder_that_is_no_run_is_refused_in_one_line(tmp_path, capsys):
    good = make_run(tmp_path / "good", [{"step": 1, "loss": 1.0}])
    no_metrics = make_run(tmp_path / "no-metrics", [])
    (no_metrics / "metrics.jsonl").unlink()
    lists_only = make_run(tmp_path / "lists", [{"step": 0, "data/item_ids": [1, 2]}])
    bad_toml = make_run(tmp_path / "bad-toml", [{"step": 1, "loss": 1.0}])
    (bad_toml / "recipe.resolved.toml").write_text("[run\n")
    (tmp_path / "empty").mkdir()
    cases = {tmp_path / "empty": "is not a run folder (it has no metrics.jsonl)",
             tmp_path / "missing": "is not a run folder (it has no metrics.jsonl)",
             no_metrics: "has logged no metrics (it has no metrics.jsonl)",
             lists_only: ": its metrics.jsonl holds no numeric metrics"}
    for folder, what in cases.items():
        assert main(["report", str(good), str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"report: {folder}{'' if what[0] == ':' else ' '}{what}"), err
        assert err.count("\n") == 1
    assert main(["report", str(good), str(bad_toml)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"report: {bad_toml / 'recipe.resolved.toml'} is not TOML")
    assert err.count("\n") == 1
    assert not (good / "report.html").exists()  # nothing written


def test_the_report_is_overwritten_but_never_through_a_link(tmp_path, capsys):
    run = make_run(tmp_path / "run", [{"step": 1, "loss": 1.0}])
    out = tmp_path / "deep" / "er" / "r.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    out.write_text("old")
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert out.read_text().startswith("<!doctype html>")
    assert capsys.readouterr().out == f"wrote {out} (1 run, 1 metrics)\n" * 2
    target, link = tmp_path / "target.txt", tmp_path / "link.html"
    target.write_text("keep")
    link.symlink_to(target)
    assert main(["report", str(run), "--out", str(link)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "symbolic link" in err and str(link) in err, err
    assert target.read_text() == "keep"


@pytest.mark.slow
def test_two_real_runs_through_the_cli(tmp_path):
    from tests import forkserver
    from tests.resume_helpers import CLI, _env, run_cli

    small = ("algo.prompts_per_step=2", "algo.group_size=4", "rollout.max_new_tokens=4",
             "data.validation.size=8", "train.eval_every=1", "logging.sample_every=0",
             "run.max_steps=2")
    for name, lr in (("a", "3e-4"), ("b", "3e-3")):
        done = run_cli("recipes/grpo-arith.toml", tmp_path / name, *small, f"train.lr={lr}")
        assert done.returncode == 0, done.stdout + done.stderr
    done = forkserver.run([*CLI[:3], "report", str(tmp_path / "a"), str(tmp_path / "b")],
                          cwd=REPO, env=_env(), timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stdout + done.stderr
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    keys = {k for row in rows for k, v in row.items()
            if k != "step" and isinstance(v, float | int) and not isinstance(v, bool)}
    assert {"eval/reward", "reward/mean", "loss", "time/step"} <= keys
    page = Page((tmp_path / "a" / "report.html").read_text())
    assert done.stdout == f"wrote {tmp_path / 'a' / 'report.html'} (2 runs, {len(keys)} metrics)\n"
    assert set(page.figures) == keys
    assert all(len(fig["lines"]) == 2 for fig in page.figures.values())
    diff = page.tables[("recipe", "grpo-arith [b]")]
    assert diff[1:] == [["train.lr", "0.0003", "0.003"]]


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def screenshot(page: Path, png: Path, size: tuple[int, int]) -> None:
    """Draw ``page`` (a file) in a headless browser kept off the network, into ``png``."""
    browser = next(filter(None, map(shutil.which, BROWSERS)), None)
    if browser is None:
        pytest.skip("no headless browser (apt-get install chromium; see `make browser`)")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--hide-scrollbars",
           "--force-device-scale-factor=1", f"--user-data-dir={png.parent / 'profile'}",
           # Paint the whole page before the capture: every compositor stage (raster included)
           # runs before a frame is drawn, and the capture waits for the page's virtual time
           # to pass the budget, so a loaded machine cannot cut the capture short.
           "--run-all-compositor-stages-before-draw", "--virtual-time-budget=5000",
           f"--window-size={size[0]},{size[1]}", f"--screenshot={png}", page.as_uri()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=120)[0]
    finally:  # the browser's helper processes share its session: none is left behind
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert png.is_file(), output[-2000:]


def test_a_headless_browser_draws_each_runs_lines(tmp_path):
    import numpy as np
    from PIL import Image

    steps = range(0, 11)
    a = make_run(tmp_path / "a", [{"step": s, "loss": 1.0, "reward/mean": 0.1 * s} for s in steps])
    b = make_run(tmp_path / "b", [{"step": s, "loss": 2.0, "reward/mean": 0.05 * s}
                                  for s in steps], "train.lr=1e-3")
    out, _, _ = report.report([a, b], tmp_path / "report.html")
    colours = [np.array([int(c[i:i + 2], 16) for i in (1, 3, 5)]) for c in report.PALETTE[:2]]
    # A headless browser under load sometimes captures the page before it has painted all of it;
    # a short capture is taken again (up to three times) and the checks run on the last one.
    for attempt in range(3):
        png = tmp_path / f"shot-{attempt}.png"
        screenshot(out, png, (1200, 900))
        pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
        masks = [np.abs(pixels - rgb).sum(axis=-1) <= 30 for rgb in colours]
        if all(mask.sum() > 600 for mask in masks):
            break
    rows = {}
    for run, mask in enumerate(masks):
        colour = report.PALETTE[run]
        assert mask.sum() > 600, f"run {run}'s colour {colour} is hardly drawn"
        # a flat loss is a horizontal line across the plot (the legend swatches are 14 px)
        rows[run] = np.flatnonzero(mask.sum(axis=1) >= 200)
        assert rows[run].size, f"no line of run {run}'s colour {colour}"
    assert rows[0].min() > rows[1].max()  # loss 1.0 is drawn below loss 2.0


def test_a_long_run_is_thinned_keeping_its_extremes(tmp_path):
    rows = [{"step": s, "loss": 1.0 + 9 * (s == 4321) - 5 * (s == 777)} for s in range(10_000)]
    page = Page(report.render([report.load_run(make_run(tmp_path / "long", rows))]))
    fig = page.figures["loss"]
    xy = points(fig["lines"][0])
    pairs = list(zip(xy[::2], xy[1::2], strict=True))
    assert len(pairs) <= report.MAX_POINTS and not fig["dots"]
    assert pairs[0] == at(fig["svg"], [(0, 1.0)]) and pairs[-1] == at(fig["svg"], [(9999, 1.0)])
    for spike in ((4321, 10.0), (777, -4.0)):
        assert at(fig["svg"], [spike]) in [list(p) for p in pairs]
    assert [x for x, _ in pairs] == sorted(x for x, _ in pairs)


def test_hostile_lines_are_skipped_and_huge_numbers_kept_out_of_the_axes(tmp_path):
    lines = "[" * 100_000 + "\n" + '{"step": 1%s, "loss": 1}\n' % ("0" * 400) + \
        '{"step": 2, "loss": 1%s}\n' % ("0" * 400) + '{"step": 3.0, "loss": 1e308}\n'
    run = make_run(tmp_path / "r", [{"step": 1, "loss": 0.5}, {"step": 4, "loss": 0.25}],
                   extra_lines=lines)
    loaded = report.load_run(run)
    assert loaded.skipped == 2
    assert loaded.series["loss"] == [(1, 0.5), (2, math.inf), (3, 1e308), (4, 0.25)]
    page = Page(report.render([loaded]))
    fig = page.figures["loss"]
    assert len(fig["nonfinite"]) == 2  # inf, and 1e308 (too large to scale) break the line
    assert [points(line) for line in fig["lines"]] == []  # single points: dots
    assert [[float(d["cx"]), float(d["cy"])] for d in fig["dots"]] == [
        at(fig["svg"], [p]) for p in [(1, 0.5), (4, 0.25)]]
