"""The README's table of what the shipped recipes reach, as ranges over seeds.

Runs each selected recipe through ``posttrain-run --plain recipes/NAME.toml run.seed=S
run.output_dir=<scratch folder>`` for every seed, one run at a time, and reads from the run's
``metrics.jsonl`` the held-out metrics the README's table reports: "start" is the evaluation at
step 0, "end" the last one. Only held-out accuracies, rewards and KLs are kept (no times), so
the numbers do not depend on how loaded the machine was.

Run:
``.venv/bin/python benchmarks/seed_ranges.py [--recipes grpo-arith dpo-arith ...] [--seeds 0 1 2]
[--avx2] [--threads N] [--skip-done]``.
Default: every tiny recipe of the README's table (``grpo-smollm2-arith``, 15 minutes a run, and
``grpo-rm-arith``, which needs ``runs/rm-arith``, are left out unless named), seeds 0, 1 and
2, this machine's own kernels. ``--avx2`` holds torch,
MKL and oneDNN to their AVX2 kernels in the child runs (``ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``), which reproduces an AVX2-only CPU's
numbers on an AVX-512 machine. ``--threads N`` sets ``OMP_NUM_THREADS`` in the child runs
(default: unset, torch's own choice).

Each finished run is merged at once into ``benchmarks/results/seed_ranges-<kind>.json`` (kind:
``avx512-bf16``, ``avx512``, ``amx`` or ``avx2`` from /proc/cpuinfo, plus ``-avx2-kernels``
under ``--avx2``), with the CPU's flags, torch's ``get_cpu_capability()`` in the child's
environment and the date, so an interrupted sweep keeps what it measured and ``--skip-done``
continues it. At the end it prints a markdown table: per recipe and metric the min-max range
over the seeds of the start and the end. ``--table FILE [FILE ...]`` prints the table of
saved results (one end column per file) without running anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}

# recipe -> the held-out metrics of its README row: (label, metrics.jsonl key, decimals)
ACC = ("accuracy", "eval/reward", 3)
ROWS: dict[str, list[tuple[str, str, int]]] = {
    "grpo-arith": [ACC],
    "dpo-arith": [("preference accuracy", "eval/preference_accuracy", 3),
                  ("greedy accuracy", "eval/reward", 3)],
    "grpo-dapo-arith": [ACC],
    "grpo-gspo-arith": [ACC],
    "grpo-cispo-arith": [ACC],
    "rloo-arith": [ACC],
    "ppo-arith": [ACC],
    "opd-arith": [ACC, ("exact reverse KL", "eval/reverse_kl_exact", 3)],
    "opd-cross-tokenizer": [ACC, ("reverse KL", "eval/reverse_kl", 3)],
    "grpo-smollm2-arith": [ACC],
    "ppo-vl": [("colour accuracy", "eval/reward", 3)],
    "grpo-vl": [("colour accuracy", "eval/reward", 3)],
    "opd-vl-teacher": [("reverse KL per token", "eval/reverse_kl", 2)],
    "grpo-tools": [ACC],
    "grpo-guess": [("env reward", "eval/reward", 3)],
    "rm-arith": [("pair accuracy", "eval/pair_accuracy", 3)],
    "grpo-rm-arith": [("exact-answer accuracy", "eval/reward/arithmetic_exact", 3)],
    "sft-arith": [ACC, ("NLL per trained token", "eval/nll", 3)],
    "grpo-code": [("held-out pass@1", "eval/pass@1", 3)],
}
SLOW = {"grpo-smollm2-arith"}  # 15 minutes a run on two cores: only when named
# recipes that name an earlier run's folder: only when named, after that run
CHAINED = {"grpo-rm-arith": "runs/rm-arith"}


def cpu_flags() -> list[str]:
    """The vector-extension flags of /proc/cpuinfo that decide torch's kernels."""
    try:
        words = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
    return [f for f in wanted if f in words]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def kind_name(flags: list[str], avx2_kernels: bool) -> str:
    if "amx_tile" in flags:
        kind = "amx"
    elif "avx512_bf16" in flags:
        kind = "avx512-bf16"
    elif "avx512f" in flags:
        kind = "avx512"
    else:
        kind = "avx2"
    return kind + ("-avx2-kernels" if avx2_kernels and kind != "avx2" else "")


def capability(env: dict[str, str]) -> str:
    """torch's CPU kernel level under ``env`` (the children's environment)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return done.stdout.strip() or "unknown"


def run_once(recipe: str, seed: int, env: dict[str, str]) -> dict:
    """One run of ``recipes/RECIPE.toml`` with ``run.seed=SEED`` in a scratch folder: the
    start (step 0) and end (last evaluation) of each metric of its README row."""
    with tempfile.TemporaryDirectory(prefix="seed_ranges-") as out:
        recipe_file = str(ROOT / "recipes" / f"{recipe}.toml")
        cmd = [sys.executable, "-m", "runner.cli", "--plain", recipe_file, f"run.seed={seed}",
               f"run.output_dir={out}"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if done.returncode != 0:
            sys.exit(f"{recipe} seed {seed} failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not evals or evals[0]["step"] != 0:
        sys.exit(f"{recipe} seed {seed}: no evaluation at step 0 in metrics.jsonl")
    return {"start_step": evals[0]["step"], "end_step": evals[-1]["step"],
            "start": {key: evals[0][key] for _, key, _ in ROWS[recipe]},
            "end": {key: evals[-1][key] for _, key, _ in ROWS[recipe]},
            "curve": {key: [r.get(key) for r in evals] for _, key, _ in ROWS[recipe]}}


def span(values: list[float], decimals: int) -> str:
    lo, hi = f"{min(values):.{decimals}f}", f"{max(values):.{decimals}f}"
    if lo == hi:
        return lo
    return f"{lo} to {hi}" if lo.startswith("-") else f"{lo}-{hi}"  # "-0.014-0.077" misreads


def cell(results: dict, recipe: str, which: str) -> str:
    runs = list(results.get("runs", {}).get(recipe, {}).values())
    if not runs:
        return "-"
    return " / ".join(span([r[which][key] for r in runs], dec) for _, key, dec in ROWS[recipe])


def table(files: list[dict]) -> str:
    """Markdown: recipe, metric(s), seeds, start (from the first file), one end column per
    file."""
    head = ["recipe", "held-out metric", "seeds", "start"] + [f"end, {f['kind']}" for f in files]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for recipe in ROWS:
        if not any(recipe in f.get("runs", {}) for f in files):
            continue
        seeds = sorted({int(s) for f in files for s in f.get("runs", {}).get(recipe, {})})
        first = next(f for f in files if recipe in f.get("runs", {}))
        label = " / ".join(lbl for lbl, _, _ in ROWS[recipe])
        lines.append("| " + " | ".join([f"`{recipe}`", label, ",".join(map(str, seeds)),
                                        cell(first, recipe, "start"),
                                        *(cell(f, recipe, "end") for f in files)]) + " |")
    return "\n".join(lines)


def holding(files: list[dict], recipes: list[str]) -> str:
    """Markdown: per recipe, file and seed, the first metric's start, best (and its step), end,
    and end - best (whether a run holds what it learned; higher is better)."""
    lines = ["| recipe | results | seed | start | best (step) | end | end - best |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for recipe in recipes:
        key = ROWS[recipe][0][1]
        for f in files:
            for seed, run in sorted(f.get("runs", {}).get(recipe, {}).items()):
                curve = [v for v in run["curve"][key] if v is not None]
                best = max(curve)
                step = run["start_step"] + curve.index(best) * (
                    (run["end_step"] - run["start_step"]) // max(1, len(curve) - 1))
                end = run["end"][key]
                lines.append(f"| `{recipe}` | {f['kind']} | {seed} | {run['start'][key]:.3f} | "
                             f"{best:.3f} ({step}) | {end:.3f} | {end - best:+.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", choices=sorted(ROWS),
                        default=[r for r in ROWS if r not in SLOW and r not in CHAINED])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--avx2", action="store_true", help="hold the children to AVX2 kernels")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the children")
    parser.add_argument("--skip-done", action="store_true",
                        help="skip the recipe and seed pairs the results file already has")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: "
                        "benchmarks/results/seed_ranges-<kind>.json)")
    parser.add_argument("--table", nargs="+", type=Path, metavar="FILE",
                        help="print the table of saved results files and exit")
    parser.add_argument("--holding", action="store_true", help="with --table: per seed, the "
                        "best evaluation and how far below it the run ends, of --recipes")
    args = parser.parse_args()
    if args.table:
        files = [json.loads(p.read_text()) for p in args.table]
        print(holding(files, args.recipes) if args.holding else table(files))
        return

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    if args.avx2:
        env.update(AVX2_ENV)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    flags = cpu_flags()
    kind = kind_name(flags, args.avx2)
    out = args.out or RESULTS / f"seed_ranges-{kind}.json"
    results = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    results.update({"kind": kind, "cpu": cpu_model(), "cpu_flags": flags,
                    "torch_cpu_capability": capability(env), "cores": os.cpu_count(),
                    "kernel_env": {k: env[k] for k in AVX2_ENV if k in env},
                    "omp_num_threads": env.get("OMP_NUM_THREADS", "")})
    out.parent.mkdir(parents=True, exist_ok=True)
    for recipe in args.recipes:
        if recipe in CHAINED and not (ROOT / CHAINED[recipe]).is_dir():
            sys.exit(f"{recipe} needs {CHAINED[recipe]}: run its recipe first "
                     f"(posttrain-run recipes/{Path(CHAINED[recipe]).name}.toml)")
        for seed in args.seeds:
            if args.skip_done and str(seed) in results["runs"].get(recipe, {}):
                continue
            got = run_once(recipe, seed, env)
            got["date"] = datetime.date.today().isoformat()
            results["runs"].setdefault(recipe, {})[str(seed)] = got
            out.write_text(json.dumps(results, indent=1) + "\n")  # after every run: partial
            ends = ", ".join(f"{k} {got['start'][k]:.3f} -> {got['end'][k]:.3f}"
                             for k in got["end"])
            print(f"{recipe} seed {seed}: {ends}", file=sys.stderr, flush=True)
    print(f"{kind}: {results['cpu']}, torch capability {results['torch_cpu_capability']}; "
          f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    print(table([results]))


if __name__ == "__main__":
    main()
