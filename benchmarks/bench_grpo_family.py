"""The GRPO family on one budget: every advantage estimator and policy loss, three seeds each.

Each variant is ``recipes/grpo-arith.toml`` (60 steps of 16 prompts x 8 completions, lr 5e-5
constant, held-out accuracy on 128 items every 10 steps) with the keys that make it that variant
(the shipped recipes' keys where one exists). Every run is
``posttrain-run --plain recipes/grpo-arith.toml run.seed=S run.output_dir=OUT/VARIANT-sS KEYS``;
the held-out curves are read from each run's ``metrics.jsonl``, and one
``posttrain-run report`` page overlays the seed-0 curves of every variant
(``OUT/report.html``).

Run: ``.venv/bin/python benchmarks/bench_grpo_family.py [--out DIR] [--seeds 0 1 2]
[--variants grpo gspo ...] [--jobs 2]``. Writes ``benchmarks/results/grpo_family-<kind>.json``
(per variant and seed: the curve) and prints the table of ``benchmarks/README.md``: per variant
the start, the best and the end evaluation (min-max over seeds), the end's mean +- its
standard deviation over seeds, and the largest drop of a seed's end below its own best.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seed_ranges import cpu_flags, cpu_model, kind_name  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
KEY = "eval/reward"

# variant -> the recipe keys that make grpo-arith that variant
VARIANTS: dict[str, tuple[str, ...]] = {
    "grpo": (),
    "grpo, dr_grpo": ("algo.loss_agg=dr_grpo",),
    "grpo, dual clip 3": ("algo.clip_ratio_c=3.0",),
    "rloo": ("algo.advantage=rloo",),
    "reinforce_pp": ("algo.advantage=reinforce_pp",),
    "reinforce_pp_baseline": ("algo.advantage=reinforce_pp_baseline",),
    "gspo": ("algo.policy_loss=gspo", "algo.loss_agg=seq_mean"),
    "cispo": ("algo.policy_loss=cispo",),
    "dapo": ("algo.clip_eps_low=0.2", "algo.clip_eps_high=0.28", "algo.loss_agg=token_mean",
             "algo.dynamic_sampling=filter", "algo.max_sample_batches=3",
             "reward.overlong_buffer_len=2", "reward.overlong_penalty=0.5"),
}


def folder(out: Path, variant: str, seed: int) -> Path:
    return out / f"{variant.replace(', ', '-').replace(' ', '-')}-s{seed}"


def run_one(out: Path, variant: str, seed: int, env: dict[str, str]) -> list[float]:
    run_dir = folder(out, variant, seed)
    cmd = [sys.executable, "-m", "runner.cli", "--plain", "recipes/grpo-arith.toml",
           f"run.seed={seed}", f"run.output_dir={run_dir}", f"run.name={variant}",
           "checkpoint.every_steps=1000", *VARIANTS[variant]]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"{variant} seed {seed} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r[KEY] for r in rows if KEY in r]


def table(results: dict) -> str:
    lines = ["| variant | keys | start | best | end | end, mean +- sd | largest end - best |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def span(xs: list[float]) -> str:
        lo, hi = f"{min(xs):.3f}", f"{max(xs):.3f}"
        return lo if lo == hi else f"{lo}-{hi}"

    for variant, runs in results["runs"].items():
        curves = list(runs.values())
        if not curves:
            continue
        ends = [c[-1] for c in curves]
        sd = statistics.stdev(ends) if len(ends) > 1 else 0.0
        keys = " ".join(f"`{k}`" for k in VARIANTS.get(variant, ())) or "(the recipe)"
        lines.append(f"| {variant} | {keys} | {span([c[0] for c in curves])} | "
                     f"{span([max(c) for c in curves])} | {span(ends)} | "
                     f"{statistics.mean(ends):.3f} +- {sd:.3f} | "
                     f"{min(c[-1] - max(c) for c in curves):+.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/grpo_family"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one torch thread each)")
    parser.add_argument("--table", type=Path, help="print the table of a results file and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    kind = kind_name(cpu_flags(), False)
    path = RESULTS / f"grpo_family-{kind}.json"
    results = {"kind": kind, "cpu": cpu_model(), "date": datetime.date.today().isoformat(),
               "metric": KEY, "steps": "0, 10, ..., 60",
               "runs": {v: {} for v in args.variants}}
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(v, s) for v in args.variants for s in args.seeds]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        curves = pool.map(lambda job: run_one(args.out, *job, env), jobs)
        for (variant, seed), curve in zip(jobs, curves, strict=True):
            results["runs"][variant][str(seed)] = curve
            print(f"{variant} seed {seed}: " + " ".join(f"{x:.3f}" for x in curve),
                  file=sys.stderr, flush=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    first = [str(folder(args.out, v, args.seeds[0])) for v in args.variants]
    subprocess.run([sys.executable, "-m", "runner.cli", "report", *first, "--out",
                    str(args.out / "report.html")], check=True, env=env, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    print(f"{results['cpu']} ({kind}); {path.relative_to(ROOT)}; "
          f"report: {args.out / 'report.html'}")
    print(table(results))


if __name__ == "__main__":
    main()
