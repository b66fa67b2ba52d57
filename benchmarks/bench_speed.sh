#!/usr/bin/env bash
# The speed table of benchmarks/README.md: every algorithm's tiny recipe in fp32 and bf16, and
# GRPO on SmolLM2-135M in the configurations of the speed work. Run on an idle machine.
#   bash benchmarks/bench_speed.sh [tiny|smollm2|all]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
what=${1:-all}
echo "| recipe (overrides) | s/step | time split | padded share | peak RSS MB |"
echo "| --- | --- | --- | --- | --- |"
if [ "$what" != smollm2 ]; then
    for recipe in grpo-arith ppo-arith opd-arith dpo-arith; do
        for precision in no bf16; do
            "$PY" benchmarks/bench_steps.py "recipes/$recipe.toml" --steps 10 "train.precision=$precision"
        done
        "$PY" benchmarks/bench_steps.py "recipes/$recipe.toml" --steps 10 train.padding_free=false
    done
fi
if [ "$what" != tiny ]; then
    smol=recipes/grpo-smollm2-arith.toml
    "$PY" benchmarks/bench_steps.py $smol --steps 4 train.precision=no rollout.dtype=float32 \
        algo.engine_is_correction=false
    "$PY" benchmarks/bench_steps.py $smol --steps 4
    "$PY" benchmarks/bench_steps.py $smol --steps 4 train.padding_free=false
    "$PY" benchmarks/bench_steps.py $smol --steps 4 algo.minibatches=1
    "$PY" benchmarks/bench_steps.py $smol --steps 4 algo.minibatches=1 model.lora.rank=16 \
        model.lora.alpha=32 train.lr=1e-4
fi
