"""How long a prompt's text is, in characters, whatever its shape (a string, chat messages,
multimodal content parts): what the length checks measure before anything is tokenised."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def prompt_chars(prompt: Any) -> int:
    """Characters of a prompt's text: a string (or number), or the text of chat messages."""
    if isinstance(prompt, list | tuple):
        return sum(_content_chars(m.get("content")) for m in prompt if isinstance(m, Mapping))
    return len(prompt) if isinstance(prompt, str) else len(str(prompt))


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list | tuple):  # multimodal content parts: their text
        return sum(len(p["text"]) for p in content
                   if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return 0
