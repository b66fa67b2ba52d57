"""Ray against torchrun: start-up, seconds per step, peak RSS of the whole job; and the time of one
weight sync through Ray's object store.

Run: ``.venv/bin/python benchmarks/bench_ray.py recipes/grpo-arith.toml [--steps 10]
[KEY=VALUE ...]`` prints a markdown row per layout (torchrun x2, ray colocated x2, ray separate
x2), each on a local cluster the run starts itself;
``.venv/bin/python benchmarks/bench_ray.py --sync builtin:tiny-arith`` times
``update_weights`` of a rollout actor (hf engine) through the object store (median of 5).

Start-up is the wall time until the first step's row appears; s/step the median over the steps
after the first (the rows' timing keys); peak RSS the largest sum, sampled every 0.2 s, of the
resident memory of every process of the job (driver, Ray's own processes, the actors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {
    "torchrun x2": ["launch.backend=torchrun", "launch.num_processes=2"],
    "ray colocated x2": ["launch.backend=ray", "launch.num_processes=2"],
    "ray separate x2": ["launch.backend=ray", "launch.num_processes=2",
                        "launch.placement=separate"],
}


def _tree(pid: int) -> set[int]:
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, grew = {pid}, True
    while grew:
        new = {c for c, p in parent.items() if p in found} - found
        found |= new
        grew = bool(new)
    return found


def _rss_mb(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def run_layout(recipe: str, name: str, steps: int, overrides: list[str]) -> str:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "runner.cli", "--plain", recipe, f"run.output_dir={out}",
               f"run.max_steps={steps}", "data.validation.enabled=false",
               f"checkpoint.every_steps={steps}", *LAYOUTS[name], *overrides]
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=env)
        metrics, first, peak = Path(out) / "metrics.jsonl", None, 0.0
        while proc.poll() is None:
            if first is None and metrics.exists() and metrics.read_text().strip():
                first = time.monotonic() - started
            peak = max(peak, _rss_mb(_tree(proc.pid)))
            time.sleep(0.2)
        if proc.returncode != 0:
            sys.exit(proc.stderr.read())
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    keys = [k for k in rows[-1] if k.startswith("time/")]
    per_step = [sum(r[k] for k in keys) for r in rows if r["step"] > 1]
    return (f"| {recipe} {' '.join(overrides)} | {name} | {first or float('nan'):.1f} | "
            f"{statistics.median(per_step):.3f} | {peak:.0f} |")


def sync(model: str) -> None:
    """Median time of one weight sync (put once + the actor's in-place load) over 5."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from runner.launch.payload import Payload
    from runner.launch.ray_roles import RemoteEngine, RolloutActor
    from runner.models import load_causal_lm, resolve_model_path
    from runner.recipe import load_recipe

    recipe = load_recipe("recipes/grpo-arith.toml", [f"model.path={model}", "launch.backend=ray",
                                                     "launch.num_processes=1",
                                                     "launch.placement=separate"])
    payload = Payload.of(recipe, source="bench", overrides=(), cwd=os.getcwd(), plain=True)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="warning")
    try:
        actor = ray.remote(RolloutActor).options(num_cpus=1).remote(0, payload)
        ray.get(actor.build.remote())
        engine = RemoteEngine([actor], 0, 600)
        policy = load_causal_lm(resolve_model_path(model))
        n = sum(p.numel() for p in policy.parameters())
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            engine.update_weights((k, p.detach()) for k, p in policy.named_parameters())
            times.append(time.perf_counter() - t0)
        print(f"| weight sync through the object store, {model} ({n:,} float32, "
              f"{4 * n / 2**20:.0f} MiB), hf rollout actor | "
              f"{statistics.median(times[1:]):.3f} s |")
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe", nargs="?")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sync", metavar="MODEL")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    if args.sync:
        return sync(args.sync)
    for name in LAYOUTS:
        print(run_layout(args.recipe, name, args.steps, args.overrides), flush=True)


if __name__ == "__main__":
    main()
