"""``--dry-run``: show what a recipe would do, without training.

Sections: the plan (layout, batch sizes, paths) and the fully resolved recipe; later stages add
the data source and the packed rollout input.
"""

from __future__ import annotations

from collections.abc import Sequence

import tomli_w

from runner.recipe.plan import RunPlan
from runner.recipe.resolved import recipe_hash, resolved_document
from runner.recipe.schema import Recipe


def plan_sections(recipe: Recipe, plan: RunPlan) -> list[tuple[str, list[tuple[str, str]]]]:
    """The (title, rows) sections of the dry-run."""
    return [("Plan", plan.rows() + [("recipe hash", recipe_hash(recipe)[:16])])]


def show_dry_run(recipe: Recipe, plan: RunPlan, *, source: str, overrides: Sequence[str],
                 plain: bool) -> None:
    from rich.console import Console
    from rich.syntax import Syntax
    from rich.table import Table

    console = Console(no_color=plain, force_terminal=False if plain else None)
    doc = resolved_document(recipe, overrides, source)
    doc.pop("resolved")
    console.print(f"[bold]{source}[/bold]: dry run of {recipe.run.name!r} (nothing is trained)")
    for title, rows in plan_sections(recipe, plan):
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold cyan")
        table.add_column(overflow="fold")
        for key, value in rows:
            table.add_row(key, value)
        console.print(table)
    console.print("[bold]Resolved recipe[/bold]")
    console.print(Syntax(tomli_w.dumps(doc), "toml", theme="ansi_dark") if not plain
                  else tomli_w.dumps(doc))
