"""The hf engine on the policy's own model against a copy of it (``rollout.share_policy``).

GRPO on SmolLM2-135M-Instruct (``grpo-smollm2-arith``, hf engine) in fp32
(``train.precision = "no"``: what ``auto`` picks on a CPU without native bf16), the two sides
alternated as fresh processes, ``--rounds`` times: s/step (median after step 2), the weight
sync after each update (``time/sync``) and the process's peak RSS (``wait4``).

Run: ``.venv/bin/python benchmarks/bench_share_policy.py [--rounds 3] [--steps 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_steps import recipe_args  # noqa: E402
from race_trl import launched, spread  # noqa: E402


def one(share: bool, steps: int, recipe: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "runner.cli",
               *recipe_args(f"recipes/{recipe}.toml", out, steps,
                            ["logging.sample_every=0", "rollout.engine=hf",
                             "train.precision=no", f"rollout.share_policy={str(share).lower()}"])]
        done = launched(cmd, {"OMP_NUM_THREADS": "2", **os.environ},
                        Path(out) / "metrics.jsonl")
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    late = [r for r in rows if r.get("step", 0) > 2]
    return {"s_per_step": statistics.median(r["time/step"] for r in late),
            "sync_s": statistics.median(r.get("time/sync", 0.0) for r in late),
            "rss_mib": done["rss_mib"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--recipe", default="grpo-smollm2-arith")
    args = parser.parse_args()
    seen: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):
        for share in (False, True):
            seen[share].append(one(share, args.steps, args.recipe))
            print(f"round {r + 1} share_policy={share}: {seen[share][-1]}", flush=True)
    print(f"\n| {args.recipe}, fp32, hf engine | s/step | weight sync s | peak RSS MiB |")
    print("| --- | --- | --- | --- |")
    for share, label in ((False, "a copy (share_policy = false)"),
                         (True, "the policy's own model (share_policy = true)")):
        runs = seen[share]
        print(f"| {label} | {spread([x['s_per_step'] for x in runs], 2)} | "
              f"{spread([x['sync_s'] for x in runs], 3)} | "
              f"{spread([x['rss_mib'] for x in runs], 0)} |")


if __name__ == "__main__":
    main()
