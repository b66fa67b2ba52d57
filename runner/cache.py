"""The package's cache root: ``$POSTTRAIN_HOME``, else ``~/.cache/posttrain-runner``. Built
models (``runner.models.home``) and the Arrow copies of local data files
(``runner.data.files``) live under it."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The cache root: ``$POSTTRAIN_HOME``, else ``~/.cache/posttrain-runner``."""
    configured = os.environ.get("POSTTRAIN_HOME", "")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "posttrain-runner"
