"""Rollouts overlapping training: seconds per step and the share of the rollout hidden behind
training, for ``algo.max_off_policy_steps`` = 0, 1, 2 (each run's rounds alternate, so drift
of the machine's speed hits every setting alike).

    python benchmarks/bench_overlap.py [RECIPE] [--steps 20] [--rounds 2] [--ks 0 1 2]
        [KEY=VALUE ...]

A step's seconds are read from its metrics row: synchronous, rollout + reward + update + sync;
overlapped, the wait for the batch + the reward's part on the training thread (time/reward less
time/reward_ahead) + update + the wait for the producer + sync (the producer's own sampling and,
for GRPO and PPO, rewarding run beside them). The hidden share is 1 - (both waits) / (the
producer's seconds: sampling and rewarding). The first step (nothing to overlap yet) and
held-out evaluations are left out. "reward share" is the median over steps of the training
thread's reward seconds (time/reward less time/reward_ahead) over the step's seconds.

The code recipe with a deliberately slow test suite (each test sleeps 20 ms in the program's
child process, ``benchmarks/code_suites.py``)::

    python benchmarks/bench_overlap.py recipes/grpo-code.toml --ks 0 1 \
        data.items_fn=benchmarks.code_suites.slow_tests
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_run(recipe: str, k: int, steps: int, overrides: list[str]
            ) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "runner.cli", "--plain", recipe, f"run.output_dir={out}",
               f"run.max_steps={steps}", f"algo.max_off_policy_steps={k}",
               "train.eval_every=1000", "checkpoint.every_steps=1000", *overrides]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text()
                .splitlines()]
    per_step, shares, waits, sampling = [], [], 0.0, 0.0
    for r in rows:
        if r.get("step", 0) < 2 or "time/update" not in r:
            continue
        t = {key[5:]: v for key, v in r.items() if key.startswith("time/")}
        reward = t.get("reward", 0.0)
        if k == 0:
            per_step.append(t["rollout"] + reward + t["update"] + t["sync"])
        else:
            wait = t["rollout_wait"] + t["producer_wait"]
            ahead = t.get("reward_ahead", 0.0)  # the producer's rewarding, beside the step
            reward -= ahead
            per_step.append(wait + reward + t["update"] + t["sync"])
            waits += wait
            sampling += t["rollout"] + ahead
        shares.append(reward / per_step[-1])
    hidden = 1.0 - waits / sampling if sampling else 0.0
    return statistics.median(per_step), hidden, statistics.median(shares)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe", nargs="?", default="recipes/grpo-arith.toml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    results: dict[int, list[tuple[float, float, float]]] = {k: [] for k in args.ks}
    for _ in range(args.rounds):
        for k in results:
            results[k].append(one_run(args.recipe, k, args.steps, args.overrides))
    print(f"{args.recipe}, {args.steps} steps x {args.rounds} rounds {' '.join(args.overrides)}")
    print("| max_off_policy_steps | s/step (median of rounds) | rollout hidden "
          "| reward share (training thread) |")
    print("| --- | --- | --- | --- |")
    base = statistics.median(s for s, _, _ in results[args.ks[0]])
    for k, runs in results.items():
        s = statistics.median(x for x, _, _ in runs)
        hidden = statistics.median(h for _, h, _ in runs)
        share = statistics.median(r for _, _, r in runs)
        print(f"| {k} | {s:.3f} ({base / s:.2f}x) | {'-' if k == 0 else f'{hidden:.0%}'} "
              f"| {share:.0%} |")


if __name__ == "__main__":
    main()
