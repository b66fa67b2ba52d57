"""A tiny run assembled in this process, so a test can call one step's ``produce``, ``score``
and ``consume`` directly (no CLI, no subprocess, no loop).

``tiny_run("grpo-arith", tmp_path, "algo.group_size=4")`` loads the shipped recipe (or a recipe
file, given its path) with small batches, no held-out set and the given overrides, plans it for
one rank and assembles every role it lists, exactly as ``posttrain-run`` would, with a silent
reporter and the run folder under ``tmp_path``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from runner.ranks.collective import Collective
from runner.ranks.context import SINGLE
from runner.recipe import load_recipe, make_plan
from runner.train.assembly.assemble import assemble
from runner.train.assembly.run import RunContext
from runner.ui import SilentReporter
from tests.conftest import REPO

# Small enough for a step in about a second on one CPU core; overrides come after and win.
SMALL = {
    "grpo": ("algo.prompts_per_step=2", "algo.group_size=4"),
    "ppo": ("algo.prompts_per_step=2", "algo.samples_per_prompt=2"),
    "opd": ("algo.prompts_per_step=2", "algo.samples_per_prompt=2"),
    "dpo": ("algo.pairs_per_step=4", "data.synthetic_pairs=64"),
    "sft": ("algo.examples_per_step=4",),
    "rm": ("algo.pairs_per_step=4", "data.synthetic_pairs=64"),
}
COMMON = ("data.validation.enabled=false", "logging.sample_every=0", "rollout.max_new_tokens=4",
          "run.max_steps=2")


@contextmanager
def tiny_run(recipe: str | Path, tmp_path: Path, *overrides: str) -> Iterator[RunContext]:
    """The assembled one-rank run of ``recipes/NAME.toml`` or of the recipe file at a path
    (closed on leaving the block). Shipped recipes get the ``SMALL`` batches of their kind."""
    path = recipe if isinstance(recipe, Path) else REPO / "recipes" / f"{recipe}.toml"
    small = () if isinstance(recipe, Path) else SMALL[recipe.split("-", 1)[0]]
    given = (f"run.output_dir={tmp_path / 'run'}", *COMMON, *small, *overrides)
    recipe = load_recipe(path, given)
    plan = make_plan(recipe, world_size=1)
    with SilentReporter() as reporter:
        run = assemble(recipe, plan, ctx=SINGLE, comm=Collective(SINGLE), reporter=reporter,
                       source=str(path), overrides=given)
        try:
            yield run
        finally:
            run.close()


def char_code_reward(completions: Sequence[str], items: Sequence[object]) -> list[float]:
    """Sum of the completion's character codes modulo 7: rewards that differ within a group
    whatever the tiny model samples, so group advantages are not all zero.

    >>> char_code_reward(["a", "b"], [None, None])
    [6.0, 0.0]
    """
    return [float(sum(map(ord, c)) % 7) for c in completions]
