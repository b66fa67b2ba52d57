"""Wall-clock seconds per step of a recipe, everything in the loop included (the logged
``time/step``: the step, metrics, the display, the stop check), for the comparison with
``bench_trl.py``'s timing of TRL's loop. One run of N steps (evaluation off, one checkpoint at
the end); the median of steps 3..N.

Run: ``.venv/bin/python benchmarks/bench_wall.py recipes/grpo-arith.toml [--steps 20] [KEY=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "runner.cli", "--plain", args.recipe, f"run.output_dir={out}",
               f"run.max_steps={args.steps}", "data.validation.enabled=false",
               f"checkpoint.every_steps={args.steps}", "logging.sample_every=0", *args.overrides]
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env={"OMP_NUM_THREADS": "2", **os.environ})
        if done.returncode != 0:
            sys.exit(done.stdout + done.stderr)
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    walls = [r["time/step"] for r in rows if r["step"] > 2]
    print(f"| {args.recipe} {' '.join(args.overrides)} | {statistics.median(walls):.3f} s per step "
          f"(wall, median of {len(walls)}) |")


if __name__ == "__main__":
    main()
