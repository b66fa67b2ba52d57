"""Wall-clock seconds per step of a recipe, everything in the loop included (the logged
``time/step``: the step, metrics, the display, the stop check), for the comparison with
``bench_trl.py``'s timing of TRL's loop. One run of N steps (evaluation off, one checkpoint at
the end); the median of steps 3..N.

Run:
``.venv/bin/python benchmarks/bench_wall.py recipes/grpo-arith.toml [--steps 20] [KEY=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_steps import recipe_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    rows = recipe_rows(args.recipe, args.steps, ["logging.sample_every=0", *args.overrides],
                       env={"OMP_NUM_THREADS": "2", **os.environ})
    walls = [r["time/step"] for r in rows if r["step"] > 2]
    print(f"| {args.recipe} {' '.join(args.overrides)} | {statistics.median(walls):.3f} s per step "
          f"(wall, median of {len(walls)}) |")


if __name__ == "__main__":
    main()
