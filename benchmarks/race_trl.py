"""The race against TRL: the same work on both sides, the two alternated in one run.

Each round runs, for every work, this project's recipe and then TRL's trainer on the same
model, prompts, shapes and hyperparameters (``bench_trl.py``), each as a fresh process timed
from outside:

- s/step: the median step of the run in steady state (the runner's logged ``time/step`` after
  step 2; TRL's interval between ``on_step_end`` callbacks after the first);
- start-up: from the process's launch to the start of its first step (imports, data, model
  and trainer build; the runner's first step starts ``time/step`` before its first metrics
  row is written, TRL's at its first ``on_step_begin``, or ``on_train_begin`` for PPO's own
  loop);
- peak RSS: the process's maximum resident set (``wait4``).

TRL is not part of this project's set-up: install it beside the venv's packages, e.g.
``pip install --no-deps --target DIR trl==1.16.0`` (and ``trl==1.12.0`` in DIR2 for PPO, the
last release with a PPO trainer), then

    .venv/bin/python benchmarks/race_trl.py --trl DIR --trl-ppo DIR2 [--rounds 3]
        [--works grpo,dpo,opd,ppo,smollm2,smollm2-fp32] [--smollm2] [--floor]

TRL's GRPO, DPO and PPO trainers checkpoint gradients by default (each layer recomputed in the
backward pass), the runner does not: ``grpo``, ``dpo``, ``ppo`` and ``smollm2`` race those
defaults; ``grpo-nockpt``, ``dpo-nockpt``, ``ppo-nockpt``, ``smollm2-nockpt`` and
``smollm2-fp32-nockpt`` race with neither side checkpointing, ``grpo-ckpt``, ``dpo-ckpt``,
``smollm2-ckpt``, ``smollm2-fp32-ckpt`` and ``smollm2-auto-fp32-ckpt`` (the runner's ``auto``
against TRL's fp32) with both (``train.gradient_checkpointing = true``). ``grpo-compile``,
``dpo-compile``, ``opd-compile`` and ``ppo-compile`` race the runner with ``train.compile =
true`` against TRL eager, ``grpo-compile-both``, ``dpo-compile-both`` and ``opd-compile-both``
against TRL's ``torch_compile`` (neither side checkpointing); their compilation, in the first
steps, is printed apart (the runner's first two steps, each side's whole run).

``--floor`` also runs, in every round, the tiny GRPO, DPO and OPD steps written as bare eager
torch and transformers calls (``floor_step.py``: the same models and shapes, padded batches,
nothing around them) and prints them beside both sides: a trainer that makes these calls takes
at least that long; only less torch work (fewer positions, fewer operations) goes below it.
Beside the runner's compiled works (``grpo-compile``, ``dpo-compile``, ``opd-compile``) the
bare step has every forward compiled too (``floor_step.py --compile``).

``--smollm2`` adds GRPO on SmolLM2-135M-Instruct (``grpo-smollm2-arith``'s 6 prompts x 8, <= 16
new tokens): the runner at its own precision (``train.precision = "auto"``) with the hf and the
vLLM engine, TRL in bf16 and in fp32, and both sides in fp32 (what ``auto`` picks on a CPU without
native bf16). Medians and ranges over the rounds are printed as a table
and every run is merged into ``benchmarks/results/race_trl-<cpu kind>.json`` (by work).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_steps import recipe_args  # noqa: E402
from seed_ranges import cpu_flags, kind_name  # noqa: E402

SMOLLM2_TRL = ["grpo", "--model", "builtin:smollm2-135m-instruct", "--prompts", "6", "--tokens",
               "16", "--lr", "1e-5", "--temperature", "0.8", "--steps", "5"]

# work -> floor_step.py's arguments (the works that have a floor; the runner's compiled works
# against the bare step with every forward compiled, its warm-up past the compilation)
FLOORS = {"grpo": ["grpo", "--steps", "12"], "dpo": ["dpo", "--steps", "40"],
          "opd": ["opd", "--steps", "20"], "grpo-nockpt": ["grpo", "--steps", "12"],
          "dpo-nockpt": ["dpo", "--steps", "40"],
          "grpo-compile": ["grpo", "--steps", "12", "--warmup", "4", "--compile"],
          "dpo-compile": ["dpo", "--steps", "40", "--warmup", "6", "--compile"],
          "opd-compile": ["opd", "--steps", "20", "--warmup", "6", "--compile"]}

# work -> (label, runner recipe, runner steps, runner overrides, TRL args, which TRL)
WORKS = {
    "grpo": [("GRPO tiny (`grpo-arith`, 16 prompts x 8)", "grpo-arith", 14, [], ["grpo"], "trl")],
    # TRL's GRPOConfig checkpoints gradients by default, the runner does not: the same
    # choice on both sides, each way
    "grpo-nockpt": [("GRPO tiny, neither side checkpointing", "grpo-arith", 14, [],
                     ["grpo", "--no-checkpointing"], "trl")],
    "grpo-ckpt": [("GRPO tiny, both sides checkpointing", "grpo-arith", 14,
                   ["train.gradient_checkpointing=true"], ["grpo"], "trl")],
    "dpo": [("DPO tiny (`dpo-arith`, 16 pairs)", "dpo-arith", 40, [], ["dpo"], "trl")],
    "dpo-nockpt": [("DPO tiny, neither side checkpointing", "dpo-arith", 40, [],
                    ["dpo", "--no-checkpointing"], "trl")],
    "dpo-ckpt": [("DPO tiny, both sides checkpointing", "dpo-arith", 40,
                  ["train.gradient_checkpointing=true"], ["dpo"], "trl")],
    "opd": [("OPD tiny (`opd-arith`, 16 x 2, exact KL)", "opd-arith", 20, [],
             ["opd", "--lr", "1e-4", "--steps", "20", "--no-score"], "trl")],
    "ppo": [("PPO tiny (`ppo-arith`, 32 x 2, critic; TRL 1.12's PPO)", "ppo-arith", 10, [],
             ["ppo", "--prompts", "32", "--group", "2", "--steps", "8"], "trl_ppo")],
    "ppo-nockpt": [("PPO tiny, neither side checkpointing (TRL 1.12's PPO)", "ppo-arith", 10, [],
                    ["ppo", "--prompts", "32", "--group", "2", "--steps", "8",
                     "--no-checkpointing"], "trl_ppo")],
    # train.compile (torch.compile of the models' forwards) against TRL eager and against
    # TRL's torch_compile; neither side checkpointing. The compilation falls in the first
    # steps, which the medians leave out (the runs' first steps are printed beside them).
    "grpo-compile": [("GRPO tiny, runner compiled vs TRL eager", "grpo-arith", 14,
                      ["train.compile=true"], ["grpo", "--no-checkpointing"], "trl")],
    "grpo-compile-both": [("GRPO tiny, both compiled", "grpo-arith", 14, ["train.compile=true"],
                           ["grpo", "--no-checkpointing", "--compile"], "trl")],
    "dpo-compile": [("DPO tiny, runner compiled vs TRL eager", "dpo-arith", 40,
                     ["train.compile=true"], ["dpo", "--no-checkpointing"], "trl")],
    "dpo-compile-both": [("DPO tiny, both compiled", "dpo-arith", 40, ["train.compile=true"],
                          ["dpo", "--no-checkpointing", "--compile"], "trl")],
    "opd-compile": [("OPD tiny, runner compiled vs TRL eager", "opd-arith", 20,
                     ["train.compile=true"], ["opd", "--lr", "1e-4", "--steps", "20",
                                              "--no-score"], "trl")],
    "opd-compile-both": [("OPD tiny, both compiled", "opd-arith", 20, ["train.compile=true"],
                          ["opd", "--lr", "1e-4", "--steps", "20", "--no-score", "--compile"],
                          "trl")],
    "ppo-compile": [("PPO tiny, runner compiled vs TRL 1.12 eager", "ppo-arith", 10,
                     ["train.compile=true"], ["ppo", "--prompts", "32", "--group", "2", "--steps",
                                              "8", "--no-checkpointing"], "trl_ppo")],
    "smollm2": [
        ("GRPO SmolLM2-135M, runner auto (hf engine) vs TRL bf16", "grpo-smollm2-arith", 5,
         ["rollout.engine=hf"], [*SMOLLM2_TRL, "--bf16"], "trl"),
        ("GRPO SmolLM2-135M, runner auto (vLLM engine) vs TRL bf16", "grpo-smollm2-arith", 5,
         [], [*SMOLLM2_TRL, "--bf16"], "trl"),
        ("GRPO SmolLM2-135M, runner auto (hf engine) vs TRL fp32", "grpo-smollm2-arith", 5,
         ["rollout.engine=hf"], SMOLLM2_TRL, "trl"),
    ],
    "smollm2-nockpt": [
        ("GRPO SmolLM2-135M, both bf16, neither checkpointing (runner auto, hf engine)",
         "grpo-smollm2-arith", 5, ["rollout.engine=hf"], [*SMOLLM2_TRL, "--bf16",
                                                           "--no-checkpointing"], "trl"),
    ],
    "smollm2-ckpt": [
        ("GRPO SmolLM2-135M, both bf16 and checkpointing (runner auto, hf engine)",
         "grpo-smollm2-arith", 5, ["rollout.engine=hf", "train.gradient_checkpointing=true"],
         [*SMOLLM2_TRL, "--bf16"], "trl"),
    ],
    "smollm2-vllm-ckpt": [
        ("GRPO SmolLM2-135M, both bf16, both checkpointing (runner auto, vLLM engine)",
         "grpo-smollm2-arith", 5, ["train.gradient_checkpointing=true"],
         [*SMOLLM2_TRL, "--bf16"], "trl"),
    ],
    # what auto picks on a CPU without native bf16: the hf engine on the policy's own model
    "smollm2-fp32": [
        ("GRPO SmolLM2-135M, both fp32 (runner hf engine on the policy's model)",
         "grpo-smollm2-arith", 5, ["rollout.engine=hf", "train.precision=no"], SMOLLM2_TRL,
         "trl"),
    ],
    "smollm2-fp32-ckpt": [
        ("GRPO SmolLM2-135M, both fp32, both checkpointing (runner hf engine)",
         "grpo-smollm2-arith", 5, ["rollout.engine=hf", "train.precision=no",
                                   "train.gradient_checkpointing=true"], SMOLLM2_TRL, "trl"),
    ],
    "smollm2-fp32-nockpt": [
        ("GRPO SmolLM2-135M, both fp32, neither checkpointing (runner hf engine)",
         "grpo-smollm2-arith", 5, ["rollout.engine=hf", "train.precision=no"],
         [*SMOLLM2_TRL, "--no-checkpointing"], "trl"),
    ],
    # the precision each side's user picks on this CPU: the runner's auto (bf16 here) against
    # TRL's default fp32, both checkpointing
    "smollm2-auto-fp32-ckpt": [
        ("GRPO SmolLM2-135M, runner auto (hf engine) vs TRL fp32, both checkpointing",
         "grpo-smollm2-arith", 5, ["rollout.engine=hf", "train.gradient_checkpointing=true"],
         SMOLLM2_TRL, "trl"),
    ],
}


def launched(cmd: list[str], env: dict[str, str], metrics: Path | None = None) -> dict:
    """Run ``cmd`` to its end; its output, peak RSS and, for a runner run (``metrics``), the
    wall-clock time its first step started."""
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    first = None
    # waitid(WNOWAIT) sees the exit without reaping the child: wait4 below collects its rusage
    while metrics is not None and first is None and os.waitid(
            os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                row = json.loads(line) if line.endswith("}") else {}
                if row.get("step") == 1:
                    first = time.time() - row["time/step"]
        time.sleep(0.005)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    text = "".join(out)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-4000:]}")
    return {"start": start, "first": first, "wall_s": time.time() - start,
            "rss_mib": usage.ru_maxrss / 1024, "output": text}


def runner_side(recipe: str, steps: int, overrides: list[str], env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "runner.cli",
               *recipe_args(f"recipes/{recipe}.toml", out, steps,
                            ["logging.sample_every=0", *overrides])]
        done = launched(cmd, env, Path(out) / "metrics.jsonl")
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["time/step"] for r in rows if r.get("step", 0) > 2]
    return {"s_per_step": statistics.median(steps_s), "steps": steps_s,
            "startup_s": done["first"] - done["start"], "rss_mib": done["rss_mib"],
            "wall_s": done["wall_s"], "first_steps_s": [r["time/step"] for r in rows
                                                         if 0 < r.get("step", 0) <= 2]}


def trl_side(args: list[str], env: dict[str, str]) -> dict:
    done = launched([sys.executable, str(HERE / "bench_trl.py"), *args], env)
    line = next(x for x in done["output"].splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    return {"s_per_step": result["s_per_step"], "steps": result["steps"],
            "startup_s": result["first_step_at"] - done["start"], "rss_mib": done["rss_mib"],
            "wall_s": done["wall_s"]}


def floor_side(args: list[str], env: dict[str, str]) -> dict:
    done = launched([sys.executable, str(HERE / "floor_step.py"), *args], env)
    ms = json.loads(done["output"].strip().splitlines()[-1])["ms"]
    return {"s_per_step": ms["step"] / 1000, "phases_ms": ms, "rss_mib": done["rss_mib"]}


def spread(values: list[float], digits: int) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trl", required=True, help="folder holding trl 1.16 (pip --target)")
    parser.add_argument("--trl-ppo", help="folder holding trl 1.12 (PPO)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--works", default="grpo,dpo,opd,ppo")
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--floor", action="store_true",
                        help="also time the tiny steps as bare torch calls (floor_step.py)")
    args = parser.parse_args()
    names = [w for w in args.works.split(",") if w]
    if args.smollm2:
        names += ["smollm2", "smollm2-fp32"]
    if "ppo" in names and not args.trl_ppo:
        sys.exit("--trl-ppo DIR is needed for ppo (TRL 1.16 has no PPO trainer)")
    base = {**os.environ, "OMP_NUM_THREADS": "2", "TRL_EXPERIMENTAL_SILENCE": "1"}
    paths = {"trl": args.trl, "trl_ppo": args.trl_ppo}
    runs: dict[str, list[dict]] = {}
    for rnd in range(args.rounds):
        for name in names:
            for label, recipe, steps, overrides, trl_args, which in WORKS[name]:
                env_trl = {**base, "PYTHONPATH": f"{paths[which]}:{ROOT}"}
                ours = runner_side(recipe, steps, overrides, base)
                theirs = trl_side(trl_args, env_trl)
                run = {"round": rnd, "runner": ours, "trl": theirs}
                if args.floor and name in FLOORS:
                    run["floor"] = floor_side(FLOORS[name], base)
                    print(f"round {rnd + 1}: {label}: floor "
                          f"{run['floor']['s_per_step']:.3f} s/step", flush=True)
                runs.setdefault(label, []).append(run)
                print(f"round {rnd + 1}: {label}: runner {ours['s_per_step']:.3f} s/step, "
                      f"TRL {theirs['s_per_step']:.3f}; start-up {ours['startup_s']:.1f} / "
                      f"{theirs['startup_s']:.1f} s; RSS {ours['rss_mib']:.0f} / "
                      f"{theirs['rss_mib']:.0f} MiB", flush=True)
    flags = cpu_flags()
    kind = kind_name(flags, avx2_kernels=os.environ.get("ATEN_CPU_CAPABILITY") == "avx2")
    result = HERE / "results" / f"race_trl-{kind}.json"
    kept = json.loads(result.read_text())["works"] if result.exists() else {}
    stamp = time.strftime("%Y-%m-%d")
    kept.update({label: {"date": stamp, "rounds": rs} for label, rs in runs.items()})
    result.write_text(json.dumps({"cpu_flags": flags, "works": kept}, indent=1) + "\n")
    print(f"\n{args.rounds} rounds on {kind}, alternated; median (range); every run in {result}\n")
    print("| work | TRL s/step | runner s/step | ratio (medians) | start-up runner / TRL s | "
          "peak RSS runner / TRL MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, rs in runs.items():
        ours = [r["runner"] for r in rs]
        theirs = [r["trl"] for r in rs]
        ratio = (statistics.median(x["s_per_step"] for x in ours)
                 / statistics.median(x["s_per_step"] for x in theirs))
        digits = 3 if ours[0]["s_per_step"] < 1 else 2
        print(f"| {label} | {spread([x['s_per_step'] for x in theirs], digits)} | "
              f"{spread([x['s_per_step'] for x in ours], digits)} | {ratio:.2f} | "
              f"{spread([x['startup_s'] for x in ours], 1)} / "
              f"{spread([x['startup_s'] for x in theirs], 1)} | "
              f"{spread([x['rss_mib'] for x in ours], 0)} / "
              f"{spread([x['rss_mib'] for x in theirs], 0)} |")
    compiled = {label: rs for label, rs in runs.items() if "compiled" in label}
    if compiled:  # where the compilation went: the runner's first two steps, the whole runs
        print("\n| work | runner's steps 1 and 2 s | whole run runner / TRL s |")
        print("| --- | --- | --- |")
        for label, rs in compiled.items():
            print(f"| {label} | {spread([sum(r['runner']['first_steps_s']) for r in rs], 1)} | "
                  f"{spread([r['runner']['wall_s'] for r in rs], 1)} / "
                  f"{spread([r['trl']['wall_s'] for r in rs], 1)} |")
    floored = {label: rs for label, rs in runs.items() if "floor" in rs[0]}
    if floored:
        print("\n| work | bare step s/step (compiled for a compiled runner) | runner s/step | "
              "TRL s/step | bare step / TRL | runner / bare step |")
        print("| --- | --- | --- | --- | --- | --- |")
    for label, rs in floored.items():
        med = {side: statistics.median(r[side]["s_per_step"] for r in rs)
               for side in ("floor", "runner", "trl")}
        print(f"| {label} | {spread([r['floor']['s_per_step'] for r in rs], 4)} | "
              f"{spread([r['runner']['s_per_step'] for r in rs], 4)} | "
              f"{spread([r['trl']['s_per_step'] for r in rs], 4)} | "
              f"{med['floor'] / med['trl']:.2f} | {med['runner'] / med['floor']:.2f} |")


if __name__ == "__main__":
    main()
