"""posttrain-run: parse arguments -> load the recipe -> validate -> plan -> run.

Errors are rendered for users, and the exit code picked, by ``runner.launch.entry.guarded``
(every rank enters the same way): 0 success, 1 runtime failure, 2 recipe or validation error,
130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from runner import __version__
from runner.errors import Problem, RecipeError, safe_line
from runner.launch.entry import (
    EXIT_OK,
    guarded,
    importable,
    launcher_prefix,
    line_buffered_stdout,
)

if TYPE_CHECKING:
    from runner.ranks.context import RankContext
    from runner.recipe.plan import RunPlan
    from runner.recipe.schema import Recipe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain-run",
        description="Run a post-training recipe (GRPO, PPO, OPD, DPO, SFT or a reward model) "
        "described by one TOML file.",
        epilog="Overrides: KEY=VALUE with dotted keys, e.g. algo.group_size=4 "
        "data.factory_kwargs.count=1000. Values are TOML literals; anything else is a string. "
        "Other commands: " + "; ".join(f"posttrain-run {name} {usage}"
                                       for name, (usage, _) in SUBCOMMANDS.items()) + ".",
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


def build_export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain-run export",
        description="Write a run's trained policy as a Hugging Face model folder (LoRA merged, "
        "tokenizer or processor and chat template included, a model card).")
    parser.add_argument("run_dir", help="the run's folder (its run.output_dir)")
    parser.add_argument("out_dir", help="a new or empty folder to write")
    parser.add_argument("--step", type=int, default=None,
                        help="export this step's checkpoint (default: the newest intact one)")
    return parser


def build_report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain-run report",
        description="Write one self-contained HTML file comparing runs: a chart of every logged "
        "metric per step with the runs overlaid, the final metrics and each run's recipe "
        "differences from the first.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run's folder (its run.output_dir); the first is the reference")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="the HTML file to write (default: report.html in the first run's "
                        "folder)")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Options may stand anywhere among the overrides (``RECIPE k=v --dry-run k=v``); after
    ``--`` every word is the recipe or an override (argparse's intermixed parsing does not keep
    that rule, so such a command line is parsed the plain way)."""
    return parser.parse_args(argv) if "--" in argv else parser.parse_intermixed_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    line_buffered_stdout()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        _, command = SUBCOMMANDS[argv[0]]
        return command(argv[1:])
    args = _parse(build_parser(), argv)
    return _recipe_command(lambda: _dispatch(args))


def _recipe_command(body: Callable[[], int]) -> int:
    """Run a command on a recipe where the user stands (the working directory importable), its
    errors rendered; under an outside launcher as one of its ranks."""
    importable(os.getcwd())
    prefix = launcher_prefix()
    code = guarded(body, prefix)
    if prefix:  # one rank of several under an outside launcher: leave as the launcher's ranks do
        from runner.launch.rank import leave

        leave(code)
    return code


def build_eval_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain-run eval",
        description="Evaluate the recipe's model, or a checkpoint of its run, on the recipe's "
        "held-out set with its own reward functions, engine and DataPacker: mean reward, "
        "pass@k ([eval] num_samples, pass_at) and majority voting; writes eval.json.")
    _checkpoint_arg(parser)
    parser.add_argument("--out", default="", metavar="DIR", help="where eval.json goes "
                        "(default: run.output_dir/eval/<checkpoint or model>)")
    parser.add_argument("--save-completions", action="store_true",
                        help="keep every completion's text in eval.json")
    parser.add_argument("--plain", action="store_true",
                        help="plain log lines instead of the live display")
    _recipe_args(parser)
    return parser


def _checkpoint_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default="", metavar="PATH|latest",
                        help="a checkpoint folder (RUN_DIR/checkpoints/step-N) or 'latest' (the "
                        "run's newest intact one); default: the recipe's model.path")


def _recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="the recipe file (TOML)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")


def eval_command(argv: list[str]) -> int:
    args = _parse(build_eval_parser(), argv)
    return _recipe_command(lambda: _eval(args))


def _eval(args: argparse.Namespace) -> int:
    recipe, ctx, plan = _load(args)
    _validate(recipe, args, trackers=False)  # an evaluation logs to no tracker
    from runner.eval.job import eval_job, eval_plan
    from runner.launch import launch
    from runner.ui.quiet import quiet_libraries

    quiet_libraries()
    job = eval_job(recipe, plan, checkpoint=args.checkpoint, out=args.out,
                   save_completions=args.save_completions)
    return launch(recipe, eval_plan(plan), ctx, source=args.recipe, overrides=args.overrides,
                  plain=args.plain, job=job)


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain-run serve",
        description="Serve the recipe's model, or a checkpoint of its run, behind an "
        "OpenAI-compatible endpoint on 127.0.0.1 (/v1/chat/completions, /v1/completions, "
        "/v1/models) with the recipe's engine, DataPacker and chat template; Ctrl-C stops it.")
    _checkpoint_arg(parser)
    parser.add_argument("--port", type=int, default=8000,
                        help="the port on 127.0.0.1 (0: a free one; default 8000)")
    parser.add_argument("--api-key", default="", metavar="KEY",
                        help="the key every request must present (default: a random one, "
                        "printed at start)")
    parser.add_argument("--model-name", default="", metavar="NAME",
                        help="the model's name in answers and /v1/models (default: run.name)")
    _recipe_args(parser)
    return parser


def serve_command(argv: list[str]) -> int:
    args = _parse(build_serve_parser(), argv)
    return _recipe_command(lambda: _serve(args))


def _serve(args: argparse.Namespace) -> int:
    recipe, ctx, plan = _load(args)
    if ctx is not None:
        raise RecipeError([Problem("", "serve runs as one process, not under a launcher's ranks",
                                   hint="start posttrain-run serve directly", source="serve")])
    from runner.recipe.algos import spec_of

    if spec_of(recipe).head != "lm":
        raise RecipeError([Problem("algo.kind", f"serve answers with a language model; "
                                   f"{spec_of(recipe).title} trains a score head, which "
                                   "writes no completions", got=recipe.algo.kind,
                                   hint="serve a recipe whose model generates", source="serve")])
    if not 0 <= args.port <= 65535:
        raise RecipeError([Problem("--port", "must be in [0, 65535]", got=args.port,
                                   source="serve")])
    _validate(recipe, args, trackers=False)
    from runner.eval.checkpoints import find_checkpoint
    from runner.serve import serve
    from runner.ui.quiet import quiet_libraries

    quiet_libraries()
    loaded = find_checkpoint(plan, args.checkpoint, recipe) if args.checkpoint else None
    return serve(recipe, loaded.path.resolve() if loaded else None, port=args.port,
                 api_key=args.api_key, name=args.model_name)


def export_command(argv: list[str]) -> int:
    args = build_export_parser().parse_args(argv)
    return guarded(lambda: _export(args))


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from runner.export import export
    from runner.ui.quiet import quiet_libraries

    quiet_libraries()
    out = Path(args.out_dir)
    which = "the newest step" if args.step is None else f"step {args.step}"
    print(f"exporting {args.run_dir} ({which}) to {out}")
    ckpt = export(Path(args.run_dir), out, args.step)
    print(f"exported {ckpt} -> {out}")
    return EXIT_OK


def report_command(argv: list[str]) -> int:
    args = build_report_parser().parse_args(argv)
    return guarded(lambda: _report(args))


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from runner.report import report

    out, runs, metrics = report([Path(d) for d in args.run_dirs],
                                Path(args.out) if args.out else None)
    print(safe_line(f"wrote {out} ({runs} run{'s' * (runs != 1)}, {metrics} metrics)"))
    return EXIT_OK


def _load(args: argparse.Namespace) -> tuple[Recipe, RankContext | None, RunPlan]:
    """The loading boundary: whatever a recipe file or an override holds, a recipe error. Under
    an external launcher this process is one of its ranks (the context), planned for its world."""
    from runner.launch.entry import rank_plan
    from runner.ranks.context import RankContext
    from runner.recipe import load_recipe, make_plan

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        ctx = RankContext.from_env()
        return recipe, ctx, make_plan(recipe) if ctx is None else rank_plan(recipe, ctx)
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        problem = Problem("", f"the recipe cannot be loaded ({type(exc).__name__}: {exc})",
                          hint="check the recipe and overrides for extreme values")
        raise RecipeError([problem], source=args.recipe) from exc


def _validate(recipe: Recipe, args: argparse.Namespace, *, trackers: bool = True) -> None:
    """Import every dotted path, bind its arguments and check the models (and, for a run, that
    the trackers' libraries and, for ``train.compile`` on a CPU, a C++ compiler are there):
    before any rank."""
    from runner.preflight import (
        validate_compiler,
        validate_extensions,
        validate_models,
        validate_trackers,
    )

    problems = validate_extensions(recipe, args.overrides)
    problems += validate_trackers(recipe) + validate_compiler(recipe) if trackers else []
    problems += validate_models(recipe) if not problems else []
    if problems:
        raise RecipeError(problems, source=args.recipe)


def _dispatch(args: argparse.Namespace) -> int:
    recipe, ctx, plan = _load(args)
    if args.validate_manifest:
        print(safe_line(f"{args.recipe}: recipe is valid ({recipe.algo.kind}, "
                        f"{plan.max_steps} steps)"))
        return EXIT_OK

    _validate(recipe, args)
    if args.validate:
        print(f"{args.recipe}: recipe and extensions are valid ({recipe.algo.kind})")
        return EXIT_OK
    from runner.preflight import state_problems

    problems = state_problems(recipe, plan.world_size)  # a layout larger than the device
    if problems:
        raise RecipeError(problems, source=args.recipe)
    from runner.ui.quiet import quiet_libraries

    quiet_libraries()
    if args.dry_run:
        from runner.preview import show_dry_run

        show_dry_run(recipe, plan, source=args.recipe, overrides=args.overrides, plain=args.plain)
        return EXIT_OK

    from runner.launch import launch

    return launch(recipe, plan, ctx, source=args.recipe, overrides=args.overrides,
                  plain=args.plain)


# The commands beside running a recipe: name -> (usage, handler of the arguments after the name).
SUBCOMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "eval": ("RECIPE [--checkpoint PATH|latest] [KEY=VALUE ...]", eval_command),
    "export": ("RUN_DIR [--step N] OUT_DIR", export_command),
    "serve": ("RECIPE [--checkpoint PATH|latest] [--port N] [--api-key KEY] [KEY=VALUE ...]",
              serve_command),
    "report": ("RUN_DIR [RUN_DIR ...] [--out FILE]", report_command),
}


if __name__ == "__main__":
    raise SystemExit(main())
