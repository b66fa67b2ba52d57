"""One process vs ``launch.backend = "torchrun"`` ranks: start-up, seconds per step, peak RSS,
and the time of one all-reduce of a model's gradients over gloo (127.0.0.1).

Run: ``.venv/bin/python benchmarks/bench_ranks.py recipes/grpo-arith.toml [--steps 6]
[--world 2] [KEY=VALUE ...]`` prints a markdown row per layout;
``.venv/bin/python benchmarks/bench_ranks.py --allreduce builtin:tiny-arith`` times the
all-reduce of that model's parameter count (2 ranks, float32, median of 5).
Start-up is the wall time until the first step's row appears; s/step is the median over the
steps after the first; peak RSS is the largest of any one process of the run (driver or rank).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_layout(recipe: str, world: int, steps: int, overrides: list[str]) -> str:
    with tempfile.TemporaryDirectory() as out:
        launch = ["launch.backend=torchrun", f"launch.num_processes={world}"] if world > 1 else []
        cmd = [sys.executable, "-m", "runner.cli", "--plain", recipe, f"run.output_dir={out}",
               f"run.max_steps={steps}", "data.validation.enabled=false",
               f"checkpoint.every_steps={steps}", *launch, *overrides]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        metrics, first = Path(out) / "metrics.jsonl", None
        while proc.poll() is None:
            if first is None and metrics.exists() and metrics.read_text().strip():
                first = time.monotonic() - started
            time.sleep(0.05)
        if proc.returncode != 0:
            sys.exit(proc.stderr.read())
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    keys = [k for k in rows[-1] if k.startswith("time/")]
    per_step = [sum(r[k] for k in keys) for r in rows if r["step"] > 1]
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    layout = f"torchrun x{world}" if world > 1 else "local x1"
    return (f"| {recipe} {' '.join(overrides)} | {layout} | {first or float('nan'):.1f} | "
            f"{statistics.median(per_step):.3f} | {rss_mb:.0f} |")


def allreduce_worker(n: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(n)
    times = []
    for _ in range(6):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print(f"| all-reduce of {n:,} float32 ({4 * n / 2**20:.0f} MiB), 2 ranks, gloo | "
              f"{statistics.median(times[1:]) * 1000:.1f} ms |")
    dist.destroy_process_group()


def allreduce(model: str) -> None:
    from runner.launch.torchrun import loopback_store, rank_env
    from runner.models import load_causal_lm

    n = sum(p.numel() for p in load_causal_lm(model).parameters())
    store, port, sock = loopback_store(60)
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           f"import bench_ranks; bench_ranks.allreduce_worker({n})"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=rank_env(r, 2, port, "bench"))
             for r in range(2)]
    for p in procs:
        p.wait()
    del store
    sock.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe", nargs="?")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--allreduce", metavar="MODEL")
    parser.add_argument("--only", type=int, help=argparse.SUPPRESS)  # one layout, fresh rusage
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    if args.allreduce:
        os.environ.pop("POSTTRAIN_DRIVER_PID", None)
        return allreduce(args.allreduce)
    if args.only:
        return print(run_layout(args.recipe, args.only, args.steps, args.overrides), flush=True)
    for world in (1, args.world):  # each in its own process, so peak RSS is that layout's
        subprocess.run([sys.executable, __file__, args.recipe, "--steps", str(args.steps),
                        "--only", str(world), *args.overrides], check=True)


if __name__ == "__main__":
    main()
