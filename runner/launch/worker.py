"""Entry point of one rank started by this package's launcher: ``python -m runner.launch.worker
PAYLOAD`` (``runner.launch.torchrun`` starts it with torchrun's environment)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from runner.errors import RunnerError
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
        return run_rank(recipe, rank_plan(recipe, ctx), ctx, source=payload.source,
                        overrides=payload.overrides, plain=payload.plain)

    return guarded(run, launcher_prefix())


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
