"""TRL's step time on the work of a shipped recipe, for the comparison in benchmarks/README.md.

TRL is not part of this project's set-up: install it beside the venv's packages first, e.g.
``pip install --no-deps --target /some/dir trl==1.16.0`` and run with ``PYTHONPATH=/some/dir:.``.

    bench_trl.py grpo [--model builtin:tiny-arith --prompts 16 --group 8 --tokens 6 --lr 3e-4]
    bench_trl.py grpo --model builtin:smollm2-135m-instruct --prompts 6 --tokens 16 --lr 1e-5
        --temperature 0.8 --steps 5 --bf16
    bench_trl.py dpo
    bench_trl.py opd [--lr 1e-4 --steps 60]

GRPO: the recipe's prompts (rendered by this project's packer, so the token ids are the same),
``group`` completions each, two optimizer steps per generation batch (the recipes' two
minibatches), no KL term, generation by transformers; prints the median seconds per generation
batch (one runner step) after the first. DPO: ``dpo-arith``'s pairs (the answer preferred to the
answer plus one), 16 a step, beta 0.3, the sigmoid loss plus the SFT term with weight 1, a
reference model; prints the median seconds per optimizer step after the first. OPD:
``opd-arith``'s work (student ``builtin:tiny-arith``, teacher ``builtin:tiny-arith-teacher``, 32
sampled sequences of <= 6 tokens a step, the exact reverse KL at every completion token, lr
1e-4) through TRL's ``DistillationTrainer`` (``beta = 1``: reverse KL); prints the median seconds
per step after the first, then the trained student's held-out exact reverse KL measured by this
project's own evaluation (``opd-arith``'s step-0 evaluation with ``model.path`` set to TRL's
result), so both sides are scored alike. fp32 unless ``--bf16``; two intra-op threads unless
OMP_NUM_THREADS is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("algo", choices=["grpo", "dpo", "opd", "ppo"])
    parser.add_argument("--model", default="builtin:tiny-arith")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="GRPO, DPO, PPO: gradient_checkpointing=False (TRL's default: True)")
    parser.add_argument("--compile", action="store_true",
                        help="TRL's torch_compile (the model compiled by the Trainer)")
    parser.add_argument("--no-score", action="store_true",
                        help="OPD: skip the held-out scoring of TRL's student (for timing races)")
    parser.add_argument("--profile", action="store_true",
                        help="print where a step goes (benchmarks/profile_step.py's summary)")
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from runner.data.arithmetic import problems
    from runner.models import load_causal_lm, read_model_type, resolve_model_path
    from runner.packers import build_packer
    from runner.rewards.builtin import final_integer
    from runner.types import ObsBundle

    path = resolve_model_path(args.model)
    packer = build_packer(path, read_model_type(path))
    tok = AutoTokenizer.from_pretrained(path)

    def prompt(p) -> str:
        item = ObsBundle(p.question, str(p.answer))
        return tok.decode(packer.engine_prompt(packer.get_rollout_input(item)).token_ids)

    def race(steps: int) -> tuple[list[float], list[float], str, int]:
        """Train ``steps`` steps; the seconds per step, the first step's wall-clock start, what
        a step is, and how many steps TRL counted (GRPO: two per generation batch)."""
        ends: list[float] = []
        begins: list[float] = []  # wall-clock (epoch) seconds, for the start-up figure

        class Timer(TrainerCallback):
            def on_train_begin(self, *a, **k):  # PPO's own loop calls no on_step_begin
                begins.append(time.time())

            def on_step_begin(self, *a, **k):
                begins.append(time.time())

            def on_step_end(self, *a, **k):
                ends.append(time.perf_counter())

        common = {"logging_steps": 10_000, "save_strategy": "no", "report_to": [], "use_cpu": True,
                  "bf16": args.bf16, "torch_compile": args.compile, "seed": 0,
                  "dataloader_num_workers": 0, "disable_tqdm": True, "learning_rate": args.lr}
        with tempfile.TemporaryDirectory() as out:
            if args.algo == "grpo":
                from trl import GRPOConfig, GRPOTrainer

                ds = Dataset.from_list([{"prompt": prompt(p), "answer": str(p.answer)}
                                        for p in problems("train", 50 * args.prompts)])

                def reward(prompts, completions, answer, **kw):
                    return [1.0 if final_integer(c) == int(a) else 0.0
                            for c, a in zip(completions, answer, strict=True)]

                cfg = GRPOConfig(output_dir=out,
                                 per_device_train_batch_size=args.prompts * args.group // 2,
                                 num_generations=args.group, steps_per_generation=2,
                                 max_completion_length=args.tokens, temperature=args.temperature,
                                 max_steps=2 * steps, beta=0.0,
                                 gradient_checkpointing=not args.no_checkpointing, **common)
                GRPOTrainer(model=load_causal_lm(path), reward_funcs=reward, args=cfg,
                            train_dataset=ds, processing_class=tok, callbacks=[Timer()]).train()
                # one generation batch each
                per = [b - a for a, b in zip(ends[1::2], ends[3::2], strict=False)]
                what = "s per generation batch (one runner step)"
            elif args.algo == "opd":
                from trl import DistillationConfig, DistillationTrainer

                ds = Dataset.from_list([{"prompt": prompt(p)} for p in problems("train", 2000)])
                cfg = DistillationConfig(output_dir=out, per_device_train_batch_size=32, beta=1.0,
                                         max_completion_length=args.tokens, temperature=1.0,
                                         gradient_checkpointing=False, max_steps=steps, **common)
                teacher = load_causal_lm(resolve_model_path("builtin:tiny-arith-teacher"))
                trainer = DistillationTrainer(model=load_causal_lm(path), teacher_model=teacher,
                                              args=cfg, train_dataset=ds, processing_class=tok,
                                              callbacks=[Timer()])
                trainer.train()
                per = [b - a for a, b in zip(ends, ends[1:], strict=False)]
                what = "s per step"
                if not args.no_score:
                    trainer.save_model(f"{out}/student")
                    tok.save_pretrained(f"{out}/student")
                    what += f"; held-out exact reverse KL {held_out_kl(f'{out}/student'):.3f}"
            elif args.algo == "ppo":
                from transformers import AutoModelForSequenceClassification
                from trl.experimental.ppo import PPOConfig, PPOTrainer

                batch = args.prompts * args.group
                ids = [tok(prompt(p), add_special_tokens=False)["input_ids"]
                       for p in problems("train", 2000)]
                ds = Dataset.from_list([{"input_ids": x} for x in ids])
                cfg = PPOConfig(output_dir=out, per_device_train_batch_size=batch,
                                local_rollout_forward_batch_size=batch, num_mini_batches=2,
                                num_ppo_epochs=2, response_length=args.tokens, kl_coef=0.02,
                                temperature=args.temperature, total_episodes=batch * (steps + 1),
                                num_sample_generations=0, stop_token="eos",
                                gradient_checkpointing=not args.no_checkpointing, **common)

                def scalar_head():
                    return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)

                PPOTrainer(args=cfg, processing_class=tok, model=load_causal_lm(path),
                           ref_model=load_causal_lm(path), reward_model=scalar_head(),
                           value_model=scalar_head(), train_dataset=ds, callbacks=[Timer()]).train()
                per = [b - a for a, b in zip(ends, ends[1:], strict=False)]
                what = "s per batch (rollout, scoring and both epochs' updates)"
            else:
                from trl import DPOConfig, DPOTrainer

                ds = Dataset.from_list([{"prompt": prompt(p), "chosen": str(p.answer),
                                         "rejected": str(p.answer + 1)}
                                        for p in problems("train", 1000)])
                cfg = DPOConfig(output_dir=out, per_device_train_batch_size=16, beta=0.3,
                                loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0],
                                max_steps=3 * steps,
                                gradient_checkpointing=not args.no_checkpointing, **common)
                DPOTrainer(model=load_causal_lm(path), ref_model=load_causal_lm(path), args=cfg,
                           train_dataset=ds, processing_class=tok, callbacks=[Timer()]).train()
                per = [b - a for a, b in zip(ends, ends[1:], strict=False)]
                what = "s per optimizer step"
        return per, begins, what, len(ends)

    if args.profile:
        profiled(args, race)
        return
    per, begins, what, _ = race(args.steps)
    # one machine-readable line for benchmarks/race_trl.py
    print("RESULT " + json.dumps({"s_per_step": statistics.median(per[1:]), "steps": per[1:],
                                  "first_step_at": begins[0]}))
    print(f"| TRL {args.algo} {args.model} {'bf16' if args.bf16 else 'fp32'} | "
          f"{statistics.median(per[1:]):.3f} {what}, median of {len(per) - 1} |")


def profiled(args: argparse.Namespace, race) -> None:
    """``profile_step.py``'s summary of TRL's step: two profiled trainings ``steps`` and
    ``2 * steps`` long, differenced so the set-up cancels; the wall time is the longer one's
    median step."""
    from profile_step import line, matmul_peak, summarize, totals
    from torch.profiler import ProfilerActivity, profile

    race(2)  # TRL's first training in a process pays one-time imports and set-up
    seen, counted = [], []
    for steps in (args.steps, 2 * args.steps):
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            per, _, _, n = race(steps)
        counted.append(n)
        seen.append(totals(prof))
    units = (counted[1] - counted[0]) / (2 if args.algo == "grpo" else 1)
    step_ms = 1e3 * statistics.median(per[1:])
    print(line(f"TRL {args.algo} {args.model}", summarize(seen[0], seen[1], units, step_ms),
               None, matmul_peak()))


def held_out_kl(student: str) -> float:
    """``eval/reverse_kl_exact`` of ``student`` at step 0 of ``opd-arith`` (nothing trained)."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-m", "runner.cli", "--plain",
                               "recipes/opd-arith.toml",
                               f"model.path={student}", f"run.output_dir={out}", "run.max_steps=1",
                               "logging.sample_every=0"], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stdout + done.stderr)
        rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    return next(r["eval/reverse_kl_exact"] for r in rows if r["step"] == 0)


if __name__ == "__main__":
    main()
