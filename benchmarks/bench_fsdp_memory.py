"""Peak resident memory per rank and seconds per step of a 2-rank torchrun run, with
``train.sharding = "none"`` (DDP: every rank a full copy) against ``"fsdp"`` (FSDP2: the
policy's parameters, gradients and AdamW state sharded over the ranks).

    python benchmarks/bench_fsdp_memory.py [RECIPE] [--steps 3] [--rounds 1] [KEY=VALUE ...]

Each rank's peak resident set (VmHWM, read from /proc while the run lasts) is measured, not
estimated; beside it the table gives the runner's own estimate of the state (``--dry-run``'s
Memory section) so the two can be compared. The runs of one round alternate between the two
settings. Seconds per step are the metrics rows' phase times (rollout + reward + update +
sync) of steps 2 and later; the weight sync's own (``time/sync``: under fsdp the gather of every
tensor to push it to the engine) beside them. The rollout engine stays the in-process hf
engine in both runs, a full copy per rank (it is not what ``train.sharding`` shards).
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

REPO = Path(__file__).resolve().parent.parent
GB = 2**30


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from each process's parent id in /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                parent[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _peak_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def one_run(recipe: str, sharding: str, steps: int, overrides: list[str]
            ) -> tuple[dict[int, float], float, float]:
    """(peak GiB per rank, median seconds per step, median seconds of the weight sync) of one
    run."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "runner.cli", "--plain", recipe, f"run.output_dir={out}",
               "launch.backend=torchrun", "launch.num_processes=2",
               f"train.sharding={sharding}", f"run.max_steps={steps}", "rollout.engine=hf",
               "train.eval_every=1000", "checkpoint.every_steps=1000", *overrides]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        peaks: dict[int, int] = {}
        while proc.poll() is None:
            for pid in _children(proc.pid):
                rank = _rank_of(pid)
                if rank is not None:
                    peaks[rank] = max(peaks.get(rank, 0), _peak_kb(pid))
            time.sleep(0.2)
        if proc.returncode != 0:
            raise SystemExit(f"{sharding} run failed:\n{proc.stderr.read() if proc.stderr else ''}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text()
                .splitlines()]
    timed = [r for r in rows if r.get("step", 0) >= 2 and "time/update" in r]
    per_step = [sum(r[f"time/{k}"] for k in ("rollout", "reward", "update", "sync"))
                for r in timed]
    sync = [r["time/sync"] for r in timed]
    return ({r: kb * 1024 / GB for r, kb in sorted(peaks.items())},
            statistics.median(per_step) if per_step else float("nan"),
            statistics.median(sync) if sync else float("nan"))


def estimate(recipe: str, overrides: list[str]) -> dict[str, str]:
    """The dry run's per-rank state estimate of the policy, both layouts."""
    from runner.preflight import estimate_state
    from runner.recipe import load_recipe

    r = load_recipe(REPO / recipe, ["launch.backend=torchrun", "launch.num_processes=2",
                                    *overrides])
    return dict(estimate_state(r, 2).rows())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/grpo-smollm2-arith.toml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results: dict[str, list[tuple[dict[int, float], float, float]]] = {"none": [], "fsdp": []}
    for _ in range(args.rounds):
        for sharding in ("none", "fsdp"):
            results[sharding].append(one_run(args.recipe, sharding, args.steps, args.overrides))
    print(f"{args.recipe}, 2 torchrun ranks, {args.steps} steps, {args.rounds} round(s)")
    print("| train.sharding | peak RSS rank 0 (GiB) | peak RSS rank 1 (GiB) | s/step | "
          "weight sync s |")
    print("| --- | --- | --- | --- | --- |")
    for sharding, runs in results.items():
        r0 = max(p.get(0, 0.0) for p, _, _ in runs)
        r1 = max(p.get(1, 0.0) for p, _, _ in runs)
        sec = statistics.median(s for _, s, _ in runs)
        sync = statistics.median(s for _, _, s in runs)
        print(f"| {sharding} | {r0:.2f} | {r1:.2f} | {sec:.2f} | {sync:.3f} |")
    for key, value in estimate(args.recipe, args.overrides).items():
        print(f"estimate: {key}: {value}")


if __name__ == "__main__":
    main()
