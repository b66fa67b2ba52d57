"""How a process enters a run and leaves it: the one entry that the CLI, the torchrun worker,
Ray's rank actors and Ray's role actors share.

- ``guarded`` runs the work and is the only code that renders the project's errors for users,
  one line each, and picks the exit code: 0 success, 1 runtime failure, 2 recipe or
  validation error, 130 interrupted. ``sys.exit`` inside the work is a failure (never 0).
- ``enter_rank`` is what a process started for a run does first, once: change to the driver's
  working directory, make it importable, quiet the libraries, parse the payload's recipe again.
- ``rank_plan`` is the plan of a rank in its launcher's world.
- ``line_buffered_stdout`` is the first thing the CLI and a rank worker do.

Imports no torch: the CLI imports this module at start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from runner.errors import Problem, RecipeError, RunnerError, safe_line
from runner.ranks.context import RankContext

if TYPE_CHECKING:
    from runner.launch.payload import Payload
    from runner.recipe.plan import RunPlan
    from runner.recipe.schema import Recipe

EXIT_OK, EXIT_FAILURE, EXIT_RECIPE, EXIT_INTERRUPTED = 0, 1, 2, 130


def guarded(run: Callable[[], int], prefix: str = "") -> int:
    """Run, rendering the project's errors as one line each and mapping them to exit codes."""
    try:
        return run()
    except RecipeError as exc:
        for line in exc.lines():
            print(prefix + line, file=sys.stderr)
        return EXIT_RECIPE
    except KeyboardInterrupt:
        print(prefix + "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # sys.exit() in user code (a dataset, packer, reward): not a success
        from runner.launch.exits import EXIT_EARLY, early_exit_line, raised_at

        print(early_exit_line(f"sys.exit({exc.code!r})", raised_at(exc.__traceback__), prefix),
              file=sys.stderr)
        return exc.code if isinstance(exc.code, int) and exc.code not in (0, 2, 130) else EXIT_EARLY
    except RunnerError as exc:
        print(safe_line(f"{prefix}error: {exc}"), file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:  # storage the runner's own writers do not wrap (the output folder)
        where = f" ({exc.filename})" if exc.filename else ""
        print(safe_line(f"{prefix}error: driver: {exc.strerror or exc} [errno {exc.errno}]{where}"),
              file=sys.stderr)
        return EXIT_FAILURE


def line_buffered_stdout() -> None:
    """Send each line printed to stdout on at its end, also where stdout is a pipe or a file
    (block-buffered there by default): step lines reach a log, a CI job or the launcher when
    they happen, not when a buffer fills or the process exits."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is None:  # replaced by an object that is no text stream
        return
    try:
        reconfigure(line_buffering=True)
    except (ValueError, OSError):  # closed, or detached from its buffer
        pass


def error_prefix(ctx: RankContext | None) -> str:
    """'rank N: ' before error lines when this process is one of several ranks."""
    return f"rank {ctx.rank}: " if ctx is not None and ctx.world_size > 1 else ""


def launcher_prefix() -> str:
    """``error_prefix`` of the rank that the launcher's environment describes; "" where it
    describes none, or none validly (reading the rank reports that)."""
    try:
        return error_prefix(RankContext.from_env())
    except RunnerError:
        return ""


def importable(folder: str) -> None:
    """Like ``python -m``, put ``folder`` (the working directory) first on the import path, so
    extension modules next to the recipe resolve by their dotted path."""
    if folder not in sys.path:
        sys.path.insert(0, folder)


def enter_rank(payload: Payload) -> Recipe:
    """Start a process of the run (a rank, a role actor) where the driver stands: its working
    directory, importable; the libraries quiet; the recipe parsed from the payload and checked
    against the driver's hash."""
    from runner.ui.quiet import quiet_libraries

    os.chdir(payload.cwd)
    importable(payload.cwd)
    quiet_libraries()
    return payload.recipe()


def rank_plan(recipe: Recipe, ctx: RankContext) -> RunPlan:
    """The plan of rank ``ctx``: the recipe on the launcher's world. A launcher that started
    another number of ranks than ``launch.num_processes`` asks for is refused."""
    from runner.recipe.plan import make_plan

    launch = recipe.launch
    if launch.backend != "local" and launch.num_processes != ctx.world_size:
        raise RecipeError([Problem(
            "launch.num_processes", f"the recipe asks for {launch.num_processes} ranks but the "
            f"launcher started {ctx.world_size}", got=launch.num_processes,
            hint=f"set launch.num_processes = {ctx.world_size}, or start "
            f"{launch.num_processes} processes")])
    return make_plan(recipe, world_size=ctx.world_size)
