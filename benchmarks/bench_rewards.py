"""Throughput of the reward stage: the ``code_tests`` reward on a batch of programs whose test
suite is slow (each test sleeps), in the trainer's thread and in 1 or 2 worker processes.

Run: ``.venv/bin/python benchmarks/bench_rewards.py [--samples 64] [--sleep 0.02] [--repeats 3]``.
Prints a markdown table: samples per second, median and range over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

from runner.recipe.schema import RewardConfig
from runner.rewards import build_rewards
from runner.types import ObsBundle

PROGRAM = "```python\nimport time\ndef f(x):\n    time.sleep({sleep})\n    return 2 * x\n```"
TESTS = "\n".join(f"assert f({i}) == {2 * i}" for i in range(4))


def rate(isolation: str, workers: int, samples: int, sleep: float) -> float:
    rs = build_rewards(RewardConfig(functions=["code_tests"], isolation=isolation,
                                    workers=workers))
    completions = [PROGRAM.format(sleep=sleep)] * samples
    items = [ObsBundle("write f", TESTS)] * samples
    rs.score(completions[:workers], items[:workers])  # the workers start
    start = time.perf_counter()
    values, _ = rs.score(completions, items)
    seconds = time.perf_counter() - start
    rs.close()
    assert values == [1.0] * samples, values
    return samples / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--sleep", type=float, default=0.02, help="seconds per test call")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sides = [("thread", 1), ("process", 1), ("process", 2)]
    seen: dict[tuple[str, int], list[float]] = {s: [] for s in sides}
    for _ in range(args.repeats):  # the sides alternate within each repeat
        for side in sides:
            seen[side].append(rate(*side, args.samples, args.sleep))
    print(f"{args.samples} samples, 4 tests each, {args.sleep:g} s per test call\n")
    print("| isolation | workers | samples/s (median) | range |\n| --- | --- | --- | --- |")
    for (isolation, workers), rates in seen.items():
        print(f"| {isolation} | {workers if isolation == 'process' else '-'} | "
              f"{statistics.median(rates):.1f} | {min(rates):.1f}-{max(rates):.1f} |")


if __name__ == "__main__":
    main()
