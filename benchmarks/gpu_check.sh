#!/usr/bin/env bash
# One short check of the CUDA path, for a GPU host with its own torch and transformers and no
# network (run benchmarks/gpu_check_prepare.sh here first; benchmarks/gpu_check/ travels along).
#   1. the project's missing pure-Python dependencies from the wheels beside it, into a folder of
#      their own (the host's packages are left as they are)
#   2. the GPU-marked tests
#   3. GRPO on a SmolLM2-135M-shaped model (random weights of the real shapes and tokenizer)
#      with the hf engine, fp32 then bf16 ("auto"): seconds per step and the time split
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU (to try the script where no GPU is).
set -euo pipefail
cd "$(dirname "$0")/.."
here=benchmarks/gpu_check
device=${GPU_CHECK_DEVICE:-cuda}
steps=${GPU_CHECK_STEPS:-4}
PY=${PY:-python3}
[ -d "$here/wheels" ] || { echo "gpu_check: run benchmarks/gpu_check_prepare.sh first" >&2; exit 2; }
if [ "$device" = cuda ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "gpu_check: no CUDA device visible to torch" >&2; exit 2; }
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" - "$here/wheels" "$work/site" <<'PYEOF'
import importlib.metadata as md, pathlib, subprocess, sys
wheels, site = pathlib.Path(sys.argv[1]), sys.argv[2]
missing = []
for w in sorted(wheels.glob("*.whl")):
    name = w.name.split("-")[0].replace("_", "-")
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(str(w))
print("gpu_check: installing", [pathlib.Path(m).name.split("-")[0] for m in missing] or "nothing")
if missing:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", site, *missing], check=True)
PYEOF
export PYTHONPATH="$PWD:$work/site" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$PY" -c "import torch, transformers, runner; print('gpu_check: torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"

echo "== GPU-marked tests"
if [ "$device" = cuda ]; then
    "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_precision.py tests/test_policy_logits.py
else
    echo "(skipped on $device)"
fi

echo "== GRPO, SmolLM2-135M shapes, hf engine, $device"
"$PY" - "$here/smollm2-shape" "$work/smollm2-random" <<'PYEOF'
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
model.save_pretrained(dst, safe_serialization=True)
for f in src.iterdir():
    if f.name != "config.json":
        shutil.copy(f, dst / f.name)
print("gpu_check: built", dst.name, sum(p.numel() for p in model.parameters()), "parameters")
PYEOF
echo "| recipe (overrides) | s/step | time split | peak RSS MB |"
for precision in no auto; do
    "$PY" benchmarks/bench_steps.py recipes/grpo-smollm2-arith.toml --steps "$steps" \
        "model.path=$work/smollm2-random" rollout.engine=hf "run.device=$device" \
        "train.precision=$precision"
done

echo "   and compiled (train.compile: the forwards through torch.compile, the first steps compile)"
"$PY" benchmarks/bench_steps.py recipes/grpo-smollm2-arith.toml --steps "$steps" \
    "model.path=$work/smollm2-random" rollout.engine=hf "run.device=$device" \
    train.precision=auto train.compile=true

echo "== sharded (train.sharding = fsdp, world size 1) and overlapped (max_off_policy_steps = 1)"
echo "   runs: the FSDP2 wrapping, bf16 mixed precision and sharded checkpoints on $device; the"
echo "   producer thread beside the update (compare time/rollout with the wait in the split)"
"$PY" benchmarks/bench_steps.py recipes/grpo-smollm2-arith.toml --steps "$steps" \
    "model.path=$work/smollm2-random" rollout.engine=hf "run.device=$device" \
    train.precision=auto train.sharding=fsdp checkpoint.every_steps=2
echo "   and LoRA on the sharded base (the adapters merged into the engine's weights on $device)"
"$PY" benchmarks/bench_steps.py recipes/grpo-smollm2-arith.toml --steps "$steps" \
    "model.path=$work/smollm2-random" rollout.engine=hf "run.device=$device" \
    train.precision=auto train.sharding=fsdp model.lora.rank=8 checkpoint.every_steps=2
"$PY" benchmarks/bench_steps.py recipes/grpo-smollm2-arith.toml --steps "$steps" \
    "model.path=$work/smollm2-random" rollout.engine=hf "run.device=$device" \
    train.precision=auto algo.max_off_policy_steps=1 algo.engine_is_correction=true
