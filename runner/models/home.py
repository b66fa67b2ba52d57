"""Where built models are cached: ``$POSTTRAIN_HOME`` (default ``~/.cache/posttrain-runner``).

A built-in model lives in ``<home>/models/<name>-v<BUILD_VERSION>``. The version is part of the
folder name so that changing how a built-in is made (bump ``BUILD_VERSION``) builds it afresh
instead of reusing a folder made by older code; old folders are left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

BUILD_VERSION = 2  # bump when any built-in's recipe changes


def home() -> Path:
    """The cache root: ``$POSTTRAIN_HOME``, else ``~/.cache/posttrain-runner``."""
    configured = os.environ.get("POSTTRAIN_HOME", "")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "posttrain-runner"


def models_dir() -> Path:
    return home() / "models"


def model_dir(name: str) -> Path:
    """The cached folder of built-in ``name`` (it may not exist yet)."""
    return models_dir() / f"{name}-v{BUILD_VERSION}"
