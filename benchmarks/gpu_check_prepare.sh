#!/usr/bin/env bash
# Run here, once, before benchmarks/gpu_check.sh travels to a CUDA host that has its own torch
# and transformers but no network. Fills benchmarks/gpu_check/ (ignored by git, never commit it):
#   wheels/          the project's pure-Python dependencies such a host may lack (Python 3.12)
#   smollm2-shape/   SmolLM2-135M-Instruct's config and tokenizer files, no weights: the check
#                    builds random weights of that shape there (timings depend on shapes only)
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/gpu_check
PY=${PY:-.venv/bin/python}
rm -rf "$out" && mkdir -p "$out/wheels" "$out/smollm2-shape"
# No dependencies are resolved here: the list is the closure minus what torch and transformers
# bring (numpy, safetensors, huggingface-hub, tqdm, pyyaml, sympy, ...).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -d "$out/wheels" \
    attrs cattrs rich markdown-it-py mdurl pygments tomli-w accelerate psutil peft \
    pytest pluggy iniconfig math-verify==0.9.0 latex2sympy2_extended antlr4-python3-runtime==4.13.2
"$PY" - "$out/smollm2-shape" <<'PYEOF'
import shutil, sys
from pathlib import Path
from runner.models import resolve_model_path

src, dst = resolve_model_path("builtin:smollm2-135m-instruct"), Path(sys.argv[1])
for f in src.iterdir():
    if f.suffix in (".json", ".jinja", ".txt") and f.name != "model.safetensors.index.json":
        shutil.copy(f, dst / f.name)
print("copied", sorted(p.name for p in dst.iterdir()))
PYEOF
du -sh "$out"/*
