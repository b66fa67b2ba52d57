"""Models: built-in tiny models, the SmolLM2 package model, and loading any model folder."""

from runner.models.loading import (
    is_multimodal,
    load_causal_lm,
    load_codec,
    load_tokenizer,
    read_model_type,
    resolve_model_path,
    text_config_value,
    text_hidden_size,
)

__all__ = [
    "is_multimodal",
    "load_causal_lm",
    "load_codec",
    "load_tokenizer",
    "read_model_type",
    "resolve_model_path",
    "text_config_value",
    "text_hidden_size",
]
