"""The live view is torn down on every way out of a run, before anything else is printed."""

from __future__ import annotations

import io
import threading

import pytest
from rich.console import Console

from runner.ui import PlainReporter, RichReporter


def terminal() -> tuple[RichReporter, io.StringIO]:
    out = io.StringIO()
    return RichReporter(Console(file=out, force_terminal=True, width=80)), out


def live_threads() -> list[threading.Thread]:
    """Refresh threads still running once told to stop (they end at their next tick)."""
    threads = [t for t in threading.enumerate() if type(t).__name__ == "_RefreshThread"]
    for thread in threads:
        thread.join(30)
    return [t for t in threads if t.is_alive()]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()],
                         ids=["exception", "ctrl-c"])
def test_leaving_the_block_by_an_exception_stops_the_live_view(exc):
    reporter, _ = terminal()
    seen_inside = []
    with pytest.raises(type(exc)):
        with reporter:
            reporter.start("run", 10, 0)
            reporter.step(1, {"loss": 0.5})
            seen_inside.append((reporter.live is not None, reporter.live.is_started))
            raise exc
    assert seen_inside == [(True, True)]
    assert reporter.live is None
    assert live_threads() == []  # the refresh thread is gone too


def test_finish_stops_the_view_then_prints_the_summary_and_close_is_idempotent():
    reporter, out = terminal()
    with reporter:
        reporter.start("run", 2, 0)
        live = reporter.live
        reporter.finish([("steps", "2/2")])
        assert reporter.live is None and not live.is_started
    reporter.close()
    assert "Summary" in out.getvalue() and "2/2" in out.getvalue()


def test_a_second_start_leaves_no_view_running():
    reporter, _ = terminal()
    with reporter:
        reporter.start("run", 2, 0)
        first = reporter.live
        reporter.start("run", 2, 1)
        assert not first.is_started and reporter.live.is_started
    assert live_threads() == []


def test_plain_reporter_is_a_context_manager_too():
    out = io.StringIO()
    with pytest.raises(ValueError), PlainReporter(out) as reporter:
        reporter.start("run", 3, 0)
        raise ValueError
    assert out.getvalue() == "run: steps 1..3\n"
