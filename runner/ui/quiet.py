"""Keep library chatter (progress bars, advisory warnings) out of the runner's own display."""

from __future__ import annotations

import os
import warnings


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    warnings.filterwarnings("ignore", message=".*TRANSFORMERS_VERBOSITY.*")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
