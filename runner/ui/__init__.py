"""Reporters (rich live view, plain lines) and the metrics log."""

from runner.ui.metrics import MetricsLog, is_timing
from runner.ui.reporter import PlainReporter, Reporter, RichReporter, make_reporter

__all__ = ["MetricsLog", "PlainReporter", "Reporter", "RichReporter", "is_timing", "make_reporter"]
