"""Resolve a recipe's ``model.path`` and load the model and tokenizer from a folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runner.errors import Problem, RecipeError

PREFIX = "builtin:"
# The generic tokenizer class under its transformers 4 and 5 names (5 writes the second on save).
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def resolve_model_path(path: str | Path, *, key: str = "model.path") -> Path:
    """``builtin:NAME`` -> its cached folder (built on first use); a folder -> itself, checked."""
    from runner.models.builtin import BUILTINS, ensure_built

    text = str(path)
    if text.startswith(PREFIX):
        name = text[len(PREFIX):]
        if name not in BUILTINS:
            raise RecipeError([Problem(key, "unknown built-in model", got=text,
                                       hint="built-in models: " + ", ".join(PREFIX + n for n in BUILTINS))])
        return ensure_built(name)
    folder = Path(text).expanduser()
    if not folder.is_dir():
        raise RecipeError([Problem(key, "model folder not found", got=text,
                                   hint="give a local Hugging Face model folder or builtin:NAME")])
    if not (folder / "config.json").is_file():
        raise RecipeError([Problem(key, "not a Hugging Face model folder (no config.json)", got=text)])
    return folder


def read_model_type(path: str | Path) -> str:
    """``model_type`` from config.json, read as plain JSON (no torch, no transformers)."""
    return str(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("model_type", ""))


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The folder's tokenizer. A folder that declares the generic fast tokenizer class gets exactly
    that: transformers would otherwise pick its model_type's tokenizer class (e.g. Qwen2's),
    whose own pre-tokenizer splits text differently from the tokenizer.json the model was
    trained with."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(path) / "tokenizer_config.json"
    declared = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") if config.is_file() else None
    if declared in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_causal_lm(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                trust_remote_code=trust_remote_code)
