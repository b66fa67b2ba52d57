"""What the driver hands each worker: plain data only, never a user object.

The recipe travels as the text of its fully resolved TOML document; the worker parses it again
and checks that it hashes to the driver's recipe, so every rank runs exactly the recipe the
driver validated. Each worker then builds its own datasets, packers and models from the
recipe's dotted paths. A job other than training (``runner.eval.job.EvalJob``) travels as its
``to_dict`` (``{}``: train).
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
from runner.eval.job import EvalJob
from runner.recipe.schema import Recipe


@attrs.frozen
class Payload:
    recipe_text: str
    recipe_hash: str
    source: str
    overrides: tuple[str, ...]
    cwd: str
    plain: bool
    job: EvalJob | None = None  # what the ranks do instead of training; None: train

    @classmethod
    def of(cls, recipe: Recipe, *, source: str, overrides: Sequence[str], cwd: str,
           plain: bool, job: EvalJob | None = None) -> Payload:
        from runner.recipe.resolved import recipe_hash, resolved_document

        text = tomli_w.dumps(resolved_document(recipe, overrides, source))
        return cls(text, recipe_hash(recipe), source, tuple(overrides), cwd, plain, job)

    def write(self, path: Path) -> None:
        from runner.state.run_folder import writing

        with writing("the ranks' payload", path, role="driver"):
            path.write_text(json.dumps(self.to_json()), encoding="utf-8")

    def to_json(self) -> dict[str, Any]:
        """The payload as its file holds it (the job as ``EvalJob.to_dict``, ``{}`` to train)."""
        return {**attrs.asdict(self, recurse=False), "overrides": list(self.overrides),
                "job": self.job.to_dict() if self.job is not None else {}}

    @classmethod
    def read(cls, path: Path) -> Payload:
        raw = json.loads(path.read_text(encoding="utf-8"))
        job = EvalJob.from_dict(raw["job"]) if raw["job"] else None
        return cls(**{**raw, "overrides": tuple(raw["overrides"]), "job": job})

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
