"""SFT on conversations of long-tailed length: equal-count micro-batches against a token budget.

Writes 2,000 arithmetic conversations whose number of turns is long-tailed (1 + an exponential
draw of mean 2, at most 12; seeded) to a scratch jsonl, then trains
``recipes/sft-arith.toml`` on them with ``builtin:tiny-arith-tools`` (a chat template with
turns), 64 conversations a step, two ways, alternated A B A B ...:

- A: ``train.grad_accum_steps = 4`` (four micro-batches of 16 conversations);
- B: ``train.max_tokens_per_microbatch = BUDGET`` (packed best-fit by tokens).

Reports per side the median and range over runs of the median ``time/step`` (steps after the
first), the loss of the last step (both sides must agree: the same update) and, for B, the
micro-batches a step and ``batch/pad_frac``. One torch thread a run.

Run: ``.venv/bin/python benchmarks/bench_token_budget.py [--runs 3] [--steps 40] [--budget 1024]``.

``--ranks 2``: GRPO on two ranks (``recipes/grpo-arith.toml``, 16 prompts of 8 completions a
step, completions of up to ``--max-new-tokens`` tokens) under the token budget, the ranks
balanced by tokens (``train.balance_ranks = true``) against each rank training the rows the data
order gave it (``false``), alternated. Reports per side the median ``time/update`` (steps after
the first; the slower rank's work plus the faster rank's wait at the all-reduce, so the wait
that balancing removes shows as the difference), ``batch/rank_imbalance`` (the most tokens any
rank trains over the ranks' mean, balanced) against ``batch/rank_imbalance_before`` (the data
order's), the micro-batches a step and the last loss (both sides must agree: the same update).

``--smollm2``: GRPO on SmolLM2-135M-Instruct with long-tailed completion lengths
(``recipes/grpo-smollm2-gsm8k-style.toml``: 4 word problems x 8 completions of up to
``--max-new-tokens`` tokens, default 128, sampled by vLLM at the recipe's own precision), one
rank, three sides alternated: padded equal-count micro-batches (``train.padding_free = false``,
``train.grad_accum_steps = 4``), padding-free equal-count micro-batches (``grad_accum_steps =
4``) and the token budget (``train.max_tokens_per_microbatch = BUDGET``, default 1024 here).
Reports per side the median ``time/step`` and ``time/update`` (steps after the first), training
tokens/s, micro-batches a step and the completion lengths (the mean, and the share of completions
cut at the limit: the long tail).

``--smollm2 --ranks 2``: the ``--ranks`` comparison on that SmolLM2 workload (its hf engine,
one torch thread a rank, 3 steps unless ``--steps``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_chats(path: Path, n: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            turns = min(12, 1 + int(rng.expovariate(0.5)))
            messages = []
            for _ in range(turns):
                a, b = rng.randint(0, 20), rng.randint(0, 20)
                messages += [{"role": "user", "content": f"What is {a} + {b}?"},
                             {"role": "assistant", "content": str(a + b)}]
            f.write(json.dumps({"messages": messages}) + "\n")


def metrics_of(out: Path, recipe: str, steps: int, threads: int, args: tuple[str, ...]
               ) -> list[dict]:
    """The metrics rows of ``steps`` steps of ``recipe`` with ``args`` (no evaluation, no
    checkpoint, no samples) into ``out``, ``threads`` torch threads a process; exits with the
    run's output when it fails."""
    cmd = [sys.executable, "-m", "runner.cli", "--plain", f"recipes/{recipe}.toml",
           "data.validation.enabled=false", f"run.max_steps={steps}",
           "checkpoint.every_steps=100000", "logging.sample_every=0", f"run.output_dir={out}",
           *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]


def run(out: Path, chats: Path, steps: int, side: tuple[str, ...]) -> list[dict]:
    return metrics_of(out, "sft-arith", steps, 1, (
        "model.path=builtin:tiny-arith-tools", f"data.path={chats}",
        "data.messages_column=messages", "algo.examples_per_step=64", *side))


def run_ranks(out: Path, steps: int, ranks: int, max_new: int, side: tuple[str, ...],
              recipe: str = "grpo-arith") -> list[dict]:
    """GRPO on ``ranks`` ranks (torchrun, gloo on 127.0.0.1); the metrics rows."""
    return metrics_of(out, recipe, steps, 1, (
        "launch.backend=torchrun", f"launch.num_processes={ranks}",
        f"rollout.max_new_tokens={max_new}", *side))


def main_ranks(args: argparse.Namespace) -> None:
    budget = f"train.max_tokens_per_microbatch={args.budget}"
    sides = {"balance_ranks=true": (budget, "train.balance_ranks=true", *args.set),
             "balance_ranks=false": (budget, "train.balance_ranks=false", *args.set)}
    per_side: dict[str, list[list[dict]]] = {name: [] for name in sides}
    recipe = "grpo-smollm2-gsm8k-style" if args.smollm2 else "grpo-arith"
    steps = 3 if args.smollm2 and args.steps == 40 else args.steps
    with tempfile.TemporaryDirectory(prefix="bench_token_budget-") as tmp:
        for i in range(args.runs):
            for name, side in sides.items():
                rows = run_ranks(Path(tmp) / f"{i}-{name}", steps, args.ranks,
                                 args.max_new_tokens, side, recipe)
                per_side[name].append([r for r in rows if "loss" in r])
                print(f"run {i + 1}, {name}: time/update " + ", ".join(
                    f"{r['time/update']:.2f}" for r in per_side[name][-1]) + " s", flush=True)
    print("| ranks | time/update s, median (range over runs) | rank imbalance (data order) | "
          "micro-batches a step | last loss |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in per_side.items():
        medians = [statistics.median(r["time/update"] for r in rows[1:] or rows)
                   for rows in runs]
        first = runs[0]
        before = statistics.mean(r["batch/rank_imbalance_before"] for r in first
                                 if "batch/rank_imbalance_before" in r) if any(
            "batch/rank_imbalance_before" in r for r in first) else None
        after = (f"{statistics.mean(r['batch/rank_imbalance'] for r in first):.3f}"
                 if before is not None else "-")
        mbs = statistics.median(r["batch/micro_batches"] for r in first)
        print(f"| `{name}` | {statistics.median(medians):.3f} ({min(medians):.3f}-"
              f"{max(medians):.3f}) | {after} ({'-' if before is None else f'{before:.3f}'}) "
              f"| {mbs:g} | {first[-1]['loss']:.6f} |")


def run_smollm2(out: Path, steps: int, max_new: int, side: tuple[str, ...]) -> list[dict]:
    return metrics_of(out, "grpo-smollm2-gsm8k-style", steps, 2, (
        "rollout.engine=vllm", f"rollout.max_new_tokens={max_new}", *side))


def main_smollm2(args: argparse.Namespace) -> None:
    sides = {"padded, grad_accum_steps=4": ("train.padding_free=false",
                                            "train.grad_accum_steps=4"),
             "padding-free, grad_accum_steps=4": ("train.grad_accum_steps=4",),
             f"max_tokens_per_microbatch={args.budget}":
                 (f"train.max_tokens_per_microbatch={args.budget}",)}
    per_side: dict[str, list[list[dict]]] = {name: [] for name in sides}
    steps = 3 if args.steps == 40 else args.steps  # the default 40 is the tiny SFT's
    with tempfile.TemporaryDirectory(prefix="bench_token_budget-") as tmp:
        for i in range(args.runs):
            for j, (name, side) in enumerate(sides.items()):
                rows = run_smollm2(Path(tmp) / f"{i}-{j}", steps, args.max_new_tokens,
                                   (*side, *args.set))
                per_side[name].append([r for r in rows if "loss" in r])
                print(f"run {i + 1}, {name}: " + ", ".join(
                    f"{r['time/step']:.1f}" for r in per_side[name][-1]) + " s", flush=True)
    print("| micro-batches | s/step, median (range over runs) | update s | train tokens/s | "
          "micro-batches a step | completion tokens, mean (share cut at the limit) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, runs in per_side.items():
        steps_med = [statistics.median(r["time/step"] for r in rows[1:]) for rows in runs]
        upd = [statistics.median(r["time/update"] for r in rows[1:]) for rows in runs]
        tok = [statistics.median(r["perf/train_tok_s"] for r in rows[1:]) for rows in runs]
        rows = [r for run_rows in runs for r in run_rows[1:]]
        mbs = statistics.median(r.get("batch/micro_batches", 8.0) for r in rows)
        lens = statistics.mean(r["completion_len"] for r in rows)
        cut = statistics.mean(r["rollout/truncated_frac"] for r in rows)
        print(f"| `{name}` | {statistics.median(steps_med):.1f} ({min(steps_med):.1f}-"
              f"{max(steps_med):.1f}) | {statistics.median(upd):.1f} | "
              f"{statistics.median(tok):.0f} | {mbs:g} | {lens:.0f} ({100 * cut:.0f}%) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=1,
                        help="2 or more: GRPO on that many ranks, balanced against not")
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help="with --ranks: the longest completion")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --ranks: a recipe override for both sides (repeatable)")
    parser.add_argument("--smollm2", action="store_true",
                        help="GRPO on SmolLM2-135M with long-tailed completions (see above)")
    args = parser.parse_args()
    if args.smollm2:
        if args.max_new_tokens == 48:
            args.max_new_tokens = 128
        if args.ranks > 1:
            main_ranks(args)
            return
        main_smollm2(args)
        return
    if args.ranks > 1:
        main_ranks(args)
        return
    sides = {"grad_accum_steps=4": ("train.grad_accum_steps=4",),
             f"max_tokens_per_microbatch={args.budget}":
                 (f"train.max_tokens_per_microbatch={args.budget}",)}
    per_side: dict[str, list[list[dict]]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory(prefix="bench_token_budget-") as tmp:
        chats = Path(tmp) / "chats.jsonl"
        write_chats(chats)
        for i in range(args.runs):
            for name, side in sides.items():
                rows = run(Path(tmp) / f"{i}-{len(per_side[name])}-{name}", chats, args.steps,
                           side)
                per_side[name].append([r for r in rows if "loss" in r])
    print("| micro-batches | s/step, median (range over runs) | last loss | micro-batches a "
          "step | pad_frac |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in per_side.items():
        medians = [statistics.median(r["time/step"] for r in rows[1:]) for rows in runs]
        last = runs[0][-1]
        mbs = statistics.median(r.get("batch/micro_batches", 4.0) for r in runs[0])
        pad = (f"{statistics.mean(r['batch/pad_frac'] for r in runs[0]):.3f}"
               if "batch/pad_frac" in last else "-")
        print(f"| `{name}` | {statistics.median(medians):.3f} ({min(medians):.3f}-"
              f"{max(medians):.3f}) | {last['loss']:.6f} | {mbs:g} | {pad} |")


if __name__ == "__main__":
    main()
