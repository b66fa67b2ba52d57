"""Keep library chatter (progress bars, advisory warnings) out of the runner's own display."""

from __future__ import annotations

import logging
import os
import sys
import warnings


class _DropMessages(logging.Filter):
    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_libraries() -> None:
    # The math_verify reward turns math-verify's signal timeouts off on purpose (they only work in
    # the main thread; reward.timeout_s bounds the call): its advisory about that is noise here.
    verify_log = logging.getLogger("math_verify.utils")
    if not any(isinstance(f, _DropMessages) for f in verify_log.filters):
        verify_log.addFilter(_DropMessages("Timeout is disabled"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # datasets draws a progress bar for every local file it converts and logs its own error
    # ("Failed to load JSON ...") before the runner's one line about the same file. Both are
    # read when datasets is imported; one already imported is told directly.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "critical")
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity(logging.CRITICAL)
    warnings.filterwarnings("ignore", message=".*TRANSFORMERS_VERBOSITY.*")
    # train.compile on a machine without CUDA: torch's C++ builder warns that it found no CUDA
    # runtime before every CPU kernel build of a run.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
