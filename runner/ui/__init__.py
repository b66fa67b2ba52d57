"""Reporters (rich live view, plain lines) and the metrics log."""

from runner.ui.metrics import MetricsLog, is_timing
from runner.ui.reporter import (
    PlainReporter,
    Reporter,
    RichReporter,
    SilentReporter,
    make_reporter,
)

__all__ = [
    "MetricsLog",
    "PlainReporter",
    "Reporter",
    "RichReporter",
    "SilentReporter",
    "is_timing",
    "make_reporter",
]
