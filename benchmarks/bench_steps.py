"""Seconds per training step, the time split and peak RSS, for each algorithm.

Runs a shipped recipe through ``posttrain-run --plain`` for a few steps in a fresh output folder
(checkpoint only at the end, evaluation off) and reads ``metrics.jsonl``. The first step is
dropped (warm-up). Peak RSS is the child process's.

Run:
``.venv/bin/python benchmarks/bench_steps.py recipes/grpo-arith.toml [--steps 6] [KEY=VALUE ...]``.
Prints a markdown table row: recipe, s/step, shares of rollout / reward / update / sync (with
``algo.max_off_policy_steps >= 1``: the waits for the batch and for the producer instead of the
rollout, and the reward's part on the training thread, ``time/reward`` less
``time/reward_ahead``; the producer's sampling and rewarding ran beside the step and are given
apart), the share of padded
positions in the training batches (padded -> as computed, i.e. after packing when
``train.padding_free``) with the positions computed as a share of the padded batch's (fewer when
prompts are shared), peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SPLIT = ("time/rollout", "time/reward", "time/teacher", "time/update", "time/sync")
# an overlapped run (algo.max_off_policy_steps >= 1): the producer's sampling (time/rollout)
# and, for GRPO and PPO, its rewarding (time/reward_ahead, a part of time/reward) run beside
# the step; the step itself waits for its batch and, at its end, for the next one
SPLIT_AHEAD = ("time/rollout_wait", "time/reward", "time/update", "time/producer_wait",
               "time/sync")


def on_thread(row: dict, key: str) -> float:
    """The training thread's seconds of ``key`` in ``row``: time/reward less the producer's
    part (time/reward_ahead), any other key as it is (0 when absent)."""
    seconds = row.get(key, 0.0)
    return seconds - row.get("time/reward_ahead", 0.0) if key == "time/reward" else seconds


def recipe_args(recipe: str, out: str, steps: int, overrides: list[str],
                checkpoint_every: int | None = None) -> list[str]:
    """``posttrain-run``'s arguments for a timed run: ``steps`` steps of ``recipe`` into
    ``out``, plain output, evaluation off, one checkpoint at the end (or every
    ``checkpoint_every`` steps), then ``overrides``."""
    return ["--plain", recipe, f"run.output_dir={out}", f"run.max_steps={steps}",
            "data.validation.enabled=false", f"checkpoint.every_steps={checkpoint_every or steps}",
            *overrides]


def recipe_rows(recipe: str, steps: int, overrides: list[str], env: dict[str, str] | None = None
                ) -> list[dict]:
    """The metrics rows of ``steps`` steps of ``recipe`` run by ``posttrain-run --plain`` in a
    fresh output folder (``recipe_args``); exits with the run's output when it fails."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "runner.cli", *recipe_args(recipe, out, steps, overrides)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            sys.exit(done.stdout + done.stderr)
        return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    rows = [r for r in recipe_rows(args.recipe, args.steps, args.overrides) if r["step"] > 1]
    ahead = all("time/rollout_wait" in r for r in rows)
    keys = SPLIT_AHEAD if ahead else SPLIT
    per_step = [sum(on_thread(r, k) for k in keys) for r in rows]
    total = sum(per_step)
    shares = {k.split("/")[1]: sum(on_thread(r, k) for r in rows) / total for k in keys
              if any(k in r for r in rows)}
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    split = ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items())
    if ahead:  # the producer's own seconds, as a share of the step it ran beside
        split += (f" (beside them, the producer sampled for "
                  f"{100 * sum(r['time/rollout'] for r in rows) / total:.0f}%")
        if any("time/reward_ahead" in r for r in rows):
            rewarded = sum(r.get("time/reward_ahead", 0.0) for r in rows)
            split += f" and rewarded for {100 * rewarded / total:.0f}%"
        split += ")"
    padding = "-"
    if all("batch/padding_share" in r for r in rows):
        before = statistics.mean(r["batch/padding_share"] for r in rows)
        after = statistics.mean(r["batch/padding_share_run"] for r in rows)
        padding = f"{100 * before:.0f}% -> {100 * after:.0f}%"
        if all("batch/positions_share" in r for r in rows):
            share = statistics.mean(r["batch/positions_share"] for r in rows)
            padding += f" ({100 * share:.0f}% of the padded positions)"
    print(f"| {args.recipe} {' '.join(args.overrides)} | {statistics.median(per_step):.2f} | "
          f"{split} | {padding} | {rss_mb:.0f} |")


if __name__ == "__main__":
    main()
