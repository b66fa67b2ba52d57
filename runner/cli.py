"""posttrain-run: parse arguments -> load the recipe -> validate -> plan -> run.

This is the only place that renders errors for users and picks exit codes:
0 success, 1 runtime failure, 2 recipe or validation error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from runner import __version__
from runner.errors import Problem, RecipeError, RunnerError, safe_line

if TYPE_CHECKING:
    from runner.recipe.plan import RunPlan
    from runner.recipe.schema import Recipe

EXIT_OK, EXIT_FAILURE, EXIT_RECIPE, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain-run",
        description="Run a post-training recipe (GRPO, DPO, PPO, OPD) described by one TOML file.",
        epilog="Overrides: KEY=VALUE with dotted keys, e.g. algo.group_size=4 "
        "data.factory_kwargs.count=1000. Values are TOML literals; anything else is a string.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--validate-manifest", action="store_true",
                      help="check the recipe only: no user code, no torch (fast)")
    mode.add_argument("--validate", action="store_true",
                      help="also import every dotted path and bind its arguments")
    mode.add_argument("--dry-run", action="store_true",
                      help="also build the data sources and packers and show the plan; no training")
    parser.add_argument("--plain", action="store_true",
                        help="plain log lines instead of the live display")
    parser.add_argument("--version", action="version", version=f"posttrain-run {__version__}")
    parser.add_argument("recipe", help="the recipe file (TOML)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Like `python -m`, make the working directory importable so extension modules next to the
    # recipe resolve by their dotted path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    prefix = _rank_prefix()
    code = _guarded(lambda: _dispatch(args), prefix)
    if prefix:  # one rank of several under an outside launcher: leave as the launcher's ranks do
        from runner.launch.rank import leave

        leave(code)
    return code


def worker_main(argv: Sequence[str]) -> int:
    """One rank started by this package's launcher: ``python -m runner.launch.worker PAYLOAD``."""
    from pathlib import Path

    from runner.launch.rank import die_with_driver

    die_with_driver()

    def run() -> int:
        from runner.launch.payload import Payload
        from runner.launch.rank import run_rank
        from runner.ranks.context import RankContext
        from runner.ui.quiet import quiet_libraries

        payload = Payload.read(Path(argv[0]))
        os.chdir(payload.cwd)
        if payload.cwd not in sys.path:
            sys.path.insert(0, payload.cwd)
        recipe = payload.recipe()
        ctx = RankContext.from_env()
        if ctx is None:
            raise RunnerError("a worker needs RANK and WORLD_SIZE in its environment")
        quiet_libraries()
        return run_rank(recipe, ctx, source=payload.source, overrides=payload.overrides,
                        plain=payload.plain)

    return _guarded(run, _rank_prefix())


def _rank_prefix() -> str:
    """'rank N: ' before error lines when this process is one of several ranks."""
    from runner.ranks.context import RankContext

    try:
        ctx = RankContext.from_env()
    except RunnerError:
        return ""
    return f"rank {ctx.rank}: " if ctx is not None and ctx.world_size > 1 else ""


def _guarded(run: Callable[[], int], prefix: str = "") -> int:
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
    except RunnerError as exc:
        print(safe_line(f"{prefix}error: {exc}"), file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:  # storage the runner's own writers do not wrap (the output folder)
        where = f" ({exc.filename})" if exc.filename else ""
        print(safe_line(f"{prefix}error: driver: {exc.strerror or exc} [errno {exc.errno}]{where}"),
              file=sys.stderr)
        return EXIT_FAILURE


def _load(args: argparse.Namespace) -> tuple[Recipe, RunPlan]:
    """The loading boundary: whatever a recipe file or an override holds, a recipe error."""
    from runner.recipe import load_recipe, make_plan

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        return recipe, make_plan(recipe)
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        problem = Problem("", f"the recipe cannot be loaded ({type(exc).__name__}: {exc})",
                          hint="check the recipe and overrides for extreme values")
        raise RecipeError([problem], source=args.recipe) from exc


def _dispatch(args: argparse.Namespace) -> int:
    recipe, plan = _load(args)
    if args.validate_manifest:
        print(safe_line(f"{args.recipe}: recipe is valid ({recipe.algo.kind}, "
                        f"{plan.max_steps} steps)"))
        return EXIT_OK

    from runner.preflight import validate_extensions, validate_models

    problems = validate_extensions(recipe)
    problems += validate_models(recipe) if not problems else []
    if problems:
        raise RecipeError(problems, source=args.recipe)
    if args.validate:
        print(f"{args.recipe}: recipe and extensions are valid ({recipe.algo.kind})")
        return EXIT_OK
    from runner.ui.quiet import quiet_libraries

    quiet_libraries()
    if args.dry_run:
        from runner.preview import show_dry_run

        show_dry_run(recipe, plan, source=args.recipe, overrides=args.overrides, plain=args.plain)
        return EXIT_OK

    from runner.launch import launch

    return launch(recipe, source=args.recipe, overrides=args.overrides, plain=args.plain)


if __name__ == "__main__":
    raise SystemExit(main())
