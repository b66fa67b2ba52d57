"""Entry point of one rank started by this package's launcher: ``python -m runner.launch.worker
PAYLOAD`` (``runner.launch.torchrun`` starts it with torchrun's environment).

An error that is none of the project's own (most often a collective that broke because another
rank died or stopped answering: gloo's traceback runs to dozens of lines) is not printed: its
traceback goes to ``<output_dir>/logs/rank-N.traceback.txt`` and the rank exits with
``EXIT_TRACEBACK``. The driver then prints one line, naming the rank that caused it and the
file.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from runner.errors import RecipeError, RunnerError
from runner.launch.entry import (
    enter_rank,
    guarded,
    launcher_prefix,
    line_buffered_stdout,
    rank_plan,
)
from runner.launch.payload import Payload
from runner.launch.rank import die_with_driver, leave, run_rank
from runner.ranks.context import RankContext

EXIT_TRACEBACK = 3  # an error none of the project's; its traceback is in traceback_path()


def traceback_path(output_dir: Path, rank: int) -> Path:
    return output_dir / "logs" / f"rank-{rank}.traceback.txt"


def logged(run: Callable[[], int], path: Path) -> int:
    """``run()``; an error that ``guarded`` would not render (none of the project's, not an
    OSError or an interrupt) is written to ``path`` with its traceback, and the rank exits with
    ``EXIT_TRACEBACK`` saying nothing: the driver names it."""
    try:
        return run()
    except (RecipeError, RunnerError, OSError, KeyboardInterrupt):
        raise
    except Exception:  # noqa: BLE001 - any error; it is kept, with its traceback, in the file
        text = traceback.format_exc()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError:
            raise RunnerError(text.rstrip().splitlines()[-1]) from None
        return EXIT_TRACEBACK


def main(argv: Sequence[str]) -> int:
    """Run the rank that the environment names on the payload file ``argv[0]``; the exit code."""
    line_buffered_stdout()
    die_with_driver()

    def run() -> int:
        payload = Payload.read(Path(argv[0]))
        recipe = enter_rank(payload)
        ctx = RankContext.from_env()
        if ctx is None:
            raise RunnerError("a worker needs RANK and WORLD_SIZE in its environment")
        plan = rank_plan(recipe, ctx)
        return logged(lambda: run_rank(recipe, plan, ctx, source=payload.source,
                                       overrides=payload.overrides, plain=payload.plain,
                                       job=payload.job),
                      traceback_path(plan.output_dir, ctx.rank))

    return guarded(run, launcher_prefix())


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
