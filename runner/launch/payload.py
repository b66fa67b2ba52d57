"""What the driver hands each worker: plain data only, never a user object.

The recipe travels as the text of its fully resolved TOML document; the worker parses it again
and checks that it hashes to the driver's recipe, so every rank runs exactly the recipe the
driver validated. Each worker then builds its own datasets, packers and models from the
recipe's dotted paths.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import tomli_w

from runner.errors import RunnerError
from runner.recipe.schema import Recipe


@attrs.frozen
class Payload:
    recipe_text: str
    recipe_hash: str
    source: str
    overrides: tuple[str, ...]
    cwd: str
    plain: bool
    job: dict[str, Any] = attrs.field(factory=dict)  # what the ranks do; empty: train

    @classmethod
    def of(cls, recipe: Recipe, *, source: str, overrides: Sequence[str], cwd: str,
           plain: bool, job: dict[str, Any] | None = None) -> Payload:
        from runner.recipe.resolved import recipe_hash, resolved_document

        text = tomli_w.dumps(resolved_document(recipe, overrides, source))
        return cls(text, recipe_hash(recipe), source, tuple(overrides), cwd, plain, dict(job or {}))

    def write(self, path: Path) -> None:
        from runner.state.run_folder import writing

        with writing("the ranks' payload", path, role="driver"):
            path.write_text(json.dumps(attrs.asdict(self)), encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> Payload:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return cls(**{**raw, "overrides": tuple(raw["overrides"])})

    def recipe(self) -> Recipe:
        """The recipe parsed again from its text; refuses one that hashes differently."""
        from runner.recipe.load import recipe_from_mapping
        from runner.recipe.resolved import recipe_hash

        recipe = recipe_from_mapping(tomllib.loads(self.recipe_text), source=self.source)
        got = recipe_hash(recipe)
        if got != self.recipe_hash:
            raise RunnerError(f"the recipe this rank parsed hashes to {got[:12]}, the driver's to "
                              f"{self.recipe_hash[:12]}: the ranks would not run the same recipe")
        return recipe
