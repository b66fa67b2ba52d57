"""Where a small recipe's step goes: torch operations by kind, and the host time around them.

Runs ``RECIPE`` in this process for ``--steps`` steps (evaluation off) under torch's profiler
and prints, per step (the difference of a run of N and one of 2N steps, so the set-up
cancels): the number of torch operations, the milliseconds spent inside them by
kind (matrix products, attention, the optimizer, copies/allocation/views, the rest:
elementwise work and reductions) and the rest of the step's wall time (Python, tokenisation,
collation, host bookkeeping: the profiled run's median step less the time inside the
operations). The profiler adds a few microseconds to every operation, so the
profiled step is slower than ``time/step`` of an unprofiled run, which is printed beside it
(the median of the same recipe's steps after the second, run first without the profiler).
``bench_trl.py --profile`` prints the same summary for TRL's trainer on the same work.

Run: ``.venv/bin/python benchmarks/profile_step.py grpo-arith [--steps 20] [KEY=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("scaled_dot_product", "flash_attention"),
    "optimizer": ("adamw", "adam_", "_foreach_"),
    "copy/alloc/view": ("aten::copy_", "aten::fill_", "aten::zero_", "aten::empty",
                        "aten::as_strided", "aten::view", "aten::slice", "aten::transpose",
                        "aten::t", "aten::cat", "aten::stack", "aten::index", "aten::select",
                        "aten::expand", "aten::reshape", "aten::_to_copy", "aten::clone",
                        "aten::contiguous", "aten::unsqueeze", "aten::squeeze", "aten::permute",
                        "aten::resize_", "aten::lift", "aten::detach", "aten::alias",
                        "aten::_unsafe_view", "aten::split", "aten::narrow", "aten::set_",
                        "aten::to", "aten::_reshape_alias", "aten::new_empty", "aten::zeros",
                        "aten::ones", "aten::full", "aten::arange", "aten::scalar_tensor"),
}


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS.items():
        if kind == "copy/alloc/view":
            if any(name == m or name.startswith(m + "_") for m in marks):
                return kind
        elif any(m in low for m in marks):
            return kind
    return "elementwise/other"


def totals(prof) -> tuple[int, dict[str, float], dict[str, tuple[int, float]], float]:
    """The aten operations a finished ``torch.profiler.profile`` saw, their self time in
    milliseconds by kind, (calls, milliseconds) by operation, and the floating-point
    operations of the matrix products (the profiler counts them with ``with_flops``)."""
    by_kind: dict[str, float] = {}
    by_op: dict[str, tuple[int, float]] = {}
    calls = 0
    flops = 0.0
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        calls += e.count
        kind = kind_of(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_cpu_time_total / 1e3
        by_op[e.key] = (e.count, e.self_cpu_time_total / 1e3)
        if kind == "matmul":
            flops += float(e.flops or 0)
    return calls, by_kind, by_op, flops


def matmul_peak(dtype: str = "float32", n: int = 1024, repeats: int = 20) -> float:
    """This machine's matrix-product rate in GFLOP/s at the process's thread count: the best of
    ``repeats`` products of two n x n matrices (what the hardware does when no per-call cost
    is left to pay)."""
    import time

    import torch

    a = torch.randn(n, n, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, dtype=getattr(torch, dtype))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def summarize(short: tuple, long: tuple, steps: float, step_ms: float) -> dict:
    """Per step, from the ``totals`` of two runs ``steps`` steps apart (so set-up cancels) and
    the profiled step's median wall time ``step_ms``: operations, milliseconds by kind, the
    wall time outside the operations, and the operations called most."""
    calls = long[0] - short[0]
    by_kind = {k: v - short[1].get(k, 0.0) for k, v in long[1].items()}
    inside = sum(by_kind.values())
    ops = {k: ((n - short[2].get(k, (0, 0.0))[0]) / steps,
               (ms - short[2].get(k, (0, 0.0))[1]) / steps) for k, (n, ms) in long[2].items()}
    return {"ops_per_step": calls / steps,
            "top_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1][0])[:25]),
            "ms_per_step": {k: v / steps for k, v in sorted(by_kind.items())},
            "inside_ops_ms": inside / steps, "profiled_step_ms": step_ms,
            "outside_ops_ms": step_ms - inside / steps,
            "matmul_gflop_per_step": (long[3] - short[3]) / steps / 1e9}


def line(label: str, summary: dict, unprofiled_ms: float | None, peak: float | None = None
         ) -> str:
    kinds = ", ".join(f"{k} {v:.1f}" for k, v in summary["ms_per_step"].items())
    base = f"{unprofiled_ms:.1f} ms unprofiled; " if unprofiled_ms is not None else ""
    top = "; ".join(f"{k[6:]} {n:.0f}" for k, (n, _) in summary["top_ops"].items())
    out = (f"{label}: {base}profiled {summary['profiled_step_ms']:.1f} ms = inside "
           f"{summary['ops_per_step']:.0f} torch operations {summary['inside_ops_ms']:.1f} "
           f"({kinds}) + outside them {summary['outside_ops_ms']:.1f}\n  calls a step: {top}")
    gflop, mm_ms = summary["matmul_gflop_per_step"], summary["ms_per_step"].get("matmul", 0.0)
    if peak and gflop and mm_ms:
        out += (f"\n  matrix products: {gflop:.2f} GFLOP a step in {mm_ms:.1f} ms "
                f"({gflop / mm_ms * 1e3:.0f} GFLOP/s; this machine's peak {peak:.0f} GFLOP/s: "
                f"{gflop / peak * 1e3:.1f} ms at the peak)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from bench_steps import recipe_args
    from torch.profiler import ProfilerActivity, profile

    from runner.cli import main as cli

    def run(out: str, steps: int) -> list[dict]:
        sys.argv = ["posttrain-run",
                    *recipe_args(f"recipes/{args.recipe}.toml", out, steps,
                                 ["logging.sample_every=0", *args.overrides],
                                 checkpoint_every=10 * steps)]
        try:
            cli()
        except SystemExit as stop:
            if stop.code not in (0, None):
                raise
        return [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]

    with tempfile.TemporaryDirectory() as out:
        rows = run(f"{out}/plain", args.steps)
        unprofiled = 1e3 * statistics.median(r["time/step"] for r in rows if r["step"] > 2)
        phases = {k: 1e3 * statistics.median(r[k] for r in rows if r["step"] > 2)
                  for k in rows[-1] if k.startswith("time/") and k != "time/step"}
        # two profiled runs, N and 2N steps: their difference is N steps without the set-up
        seen = []
        for i, steps in enumerate((args.steps, 2 * args.steps)):
            with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
                rows = run(f"{out}/profiled-{i}", steps)
            seen.append(totals(prof))
        step_ms = 1e3 * statistics.median(r["time/step"] for r in rows if r["step"] > 2)
        summary = summarize(seen[0], seen[1], args.steps, step_ms)
    print(f"torch {torch.__version__}, {os.environ['OMP_NUM_THREADS']} threads; phases (ms, "
          "unprofiled medians): " + ", ".join(f"{k[5:]} {v:.1f}" for k, v in phases.items()))
    print(line(args.recipe, summary, unprofiled, matmul_peak()))


if __name__ == "__main__":
    main()
