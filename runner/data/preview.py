"""The data rows of ``--dry-run``: build the sources as a run would, and say what they hold.

Building them runs every check a run makes before training (factory contract, columns on the
first row, train/held-out overlap), so a dry run fails where the run would.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from runner.data.preference import DatasetPreferenceEnv
from runner.data.sources import build_prompt_sources
from runner.recipe.algos import spec_of
from runner.recipe.held_out import held_out_reason
from runner.recipe.schema import Recipe

ITEM_CHARS = 200


def describe_data(recipe: Recipe) -> list[tuple[str, str]]:
    """(label, value) rows: source, size, first item, order, fingerprint, held-out set."""
    data = recipe.data
    stream = spec_of(recipe).stream
    if stream == "pairs":
        env = DatasetPreferenceEnv(data, seed=recipe.run.seed)
        train, held_out, first = env.train, env.held_out, env.train.pair(0)
    else:
        train, held_out = build_prompt_sources(data, recipe.algo.kind)
        first = train.item(0)
    info = train.describe()
    order = f"shuffled each epoch (seed {recipe.run.seed})" if data.shuffle else "file order"
    rows = [
        ("data source", f"{info['kind']}: {info['identity']}"),
        ("dataset size", info["size"]),
        ("first item", canonical(first)),
        ("order", order),
        ("fingerprint", train.fingerprint()[:16]),
        ("cursor resume", data.cursor_resume),
    ]
    if held_out is None:
        rows.append(("held-out", held_out_reason(data, stream) or "off"))
    else:
        held = held_out.describe()
        rows.append(("held-out", f"{held['size']} items, {held['kind']}: {held['identity']}"))
        if stream != "pairs":
            rows.append(("overlap check", f"training ids from {train.membership_from}, held-out "
                                          f"ids from {held_out.membership_from}"))
    return rows


def _shown(value: Any) -> Any:
    """Raw media bytes as their size, not their content."""
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes>"
    if isinstance(value, tuple):
        return [_shown(v) for v in value]
    return value


def canonical(item: Any) -> str:
    """An item as compact JSON of its non-empty fields (a field at its default, such as a pair's
    margin of 0 without a margin column, is left out), cut to ITEM_CHARS characters."""
    defaults = {f.name: f.default for f in attrs.fields(type(item))}
    fields = {k: _shown(v) for k, v in attrs.asdict(item, recurse=False).items()
              if v not in ("", (), {}, None) and k != "origin" and not (
                  isinstance(v, float) and v == defaults.get(k))}
    text = json.dumps(fields, ensure_ascii=False, default=repr)
    return text if len(text) <= ITEM_CHARS else text[:ITEM_CHARS - 3] + "..."
