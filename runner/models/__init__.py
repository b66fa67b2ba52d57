"""Models: built-in tiny models, the SmolLM2 package model, and loading any model folder."""

from runner.models.loading import (
    load_causal_lm,
    load_tokenizer,
    read_model_type,
    resolve_model_path,
)

__all__ = ["load_causal_lm", "load_tokenizer", "read_model_type", "resolve_model_path"]
