"""Where built models are cached: ``$POSTTRAIN_HOME`` (default ``~/.cache/posttrain-runner``).

A built-in model that is converted on first use (SmolLM2; the tiny ones are shipped with the
package) lives in ``<home>/models/<name>-v<BUILD_VERSION>``. The version is part of the
folder name so that changing how a built-in is made (bump ``BUILD_VERSION``) builds it afresh
instead of reusing a folder made by older code; old folders are left alone.
"""

from __future__ import annotations

from pathlib import Path

from runner.cache import home

BUILD_VERSION = 3  # bump when a built-in changes (v3: Qwen2-exact tokenizers, retuned warm-ups)


def models_dir() -> Path:
    return home() / "models"


def model_dir(name: str) -> Path:
    """The cached folder of built-in ``name`` (it may not exist yet)."""
    return models_dir() / f"{name}-v{BUILD_VERSION}"
