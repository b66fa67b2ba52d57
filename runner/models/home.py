"""Where built models are cached: ``$POSTTRAIN_HOME`` (default ``~/.cache/posttrain-runner``)."""

from __future__ import annotations

import os
from pathlib import Path

BUILD_VERSION = 1  # bump when a built-in's recipe changes: old folders are then left unused


def home() -> Path:
    return Path(os.environ.get("POSTTRAIN_HOME", Path.home() / ".cache" / "posttrain-runner"))


def model_dir(name: str) -> Path:
    return home() / "models" / f"{name}-v{BUILD_VERSION}"
