"""Does a checkpoint fit the model it is loaded into? The names and shapes of its weights and of
its optimizer state, read from the safetensors headers and compared with the model the recipe
builds (on the meta device: no weights are read or allocated), before anything is loaded.

The manifest only says that a checkpoint's files are the ones that were written; a checkpoint
whose manifest was rebuilt after a tensor was reshaped or removed verifies. Without this check
``from_pretrained`` fails with a traceback on a reshaped tensor and silently re-initialises a
missing one, and an optimizer slot of another shape loads and is saved into the next
checkpoint. ``misfit`` gives the first mismatch as one line naming the file and the tensor;
resume passes such a checkpoint over like one that does not parse (runner.state.load).

Names are compared after the renaming ``from_pretrained`` applies to a folder's keys (a
vision-language model's legacy names), so a checkpoint written by ``save_pretrained`` fits the
model it was written from. Only the policy's full weights and optimizer are checked; a LoRA
checkpoint (adapters) and the extra modules (PPO's critic) are not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
from safetensors import safe_open

from runner.state.layout import MODEL_DIR

Shape = tuple[int, ...]
SHARDED, REPLICATED = "sharded", "replicated"  # runner.train.roles.sharding's slot kinds


@attrs.frozen
class ModelShapes:
    """What a checkpoint of one model must hold."""

    state: dict[str, Shape]  # every state-dict tensor (parameters, persistent buffers)
    required: tuple[str, ...]  # the parameters (a tied one once, by its first name)
    optimizer: tuple[tuple[str, Shape], ...]  # the optimizer's parameters, in its order
    rename: Any = attrs.field(eq=False, repr=False)  # a file key -> (model key, converted)


def shapes_of(model: Any) -> ModelShapes:
    """The shapes a checkpoint of ``model`` (built as a run builds it, on the meta device) must
    hold: every parameter trains, in ``make_optimizer``'s order."""
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return ModelShapes(state, tuple(n for n, _ in params),
                       tuple((n, s) for n, s in params), _renamer(model, state))


def _renamer(model: Any, state: dict[str, Shape]) -> Any:
    """The key renaming of ``from_pretrained`` for ``model`` (identity where this transformers
    has none): file key -> (model key, whether a converter reshapes it)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # pragma: no cover - a transformers without weight conversions
        return lambda key: (key, False)
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix

    def rename(key: str) -> tuple[str, bool]:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if renamed not in state and key in state:
            renamed, pattern = rename_source_key(key, [], [], prefix, state)
        return renamed, pattern is not None

    return rename


def _headers(files: list[Path]) -> Iterator[tuple[Path, str, Shape]]:
    for path in files:
        with safe_open(path, "pt") as handle:
            for key in handle.keys():
                yield path, key, tuple(handle.get_slice(key).get_shape())


def _show(shape: Shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def misfit(folder: Path, shapes: ModelShapes, *, weights: bool = True) -> str:
    """Why checkpoint ``folder`` does not fit ``shapes``' model, or "": its model weights
    (unless ``weights`` is False: a LoRA checkpoint holds adapters) and its optimizer state."""
    return (weights and model_misfit(folder / MODEL_DIR, shapes, folder)) or optimizer_misfit(
        folder, shapes)


def model_misfit(model_dir: Path, shapes: ModelShapes, root: Path | None = None) -> str:
    """The first tensor of ``model_dir``'s safetensors files that is not the model's or has
    another shape, or the first parameter of the model they lack; "" when they fit."""
    root = root or model_dir.parent
    found: set[str] = set()
    files = sorted(model_dir.glob("*.safetensors"))
    for path, key, shape in _headers(files):
        name, converted = shapes.rename(key)
        where = path.relative_to(root).as_posix()
        if name not in shapes.state:
            return f"{where}: tensor {key!r} is not a tensor of the model"
        if not converted and shape != shapes.state[name]:
            return (f"{where}: tensor {key!r} has shape {_show(shape)} where the model has "
                    f"{_show(shapes.state[name])}")
        found.add(name)
    missing = [n for n in shapes.required if n not in found]
    if missing:
        where = model_dir.relative_to(root).as_posix()
        return (f"{where}: the model's tensor {missing[0]!r} is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return ""


def optimizer_misfit(folder: Path, shapes: ModelShapes, prefix: str = "optimizer") -> str:
    """The first optimizer tensor of checkpoint ``folder`` that does not fit its parameter:
    a whole state (``PREFIX.safetensors``): every tensor slot 0-dimensional (a step count) or
    of its parameter's shape; per-rank shards (``files`` in ``PREFIX.json``): the parameters'
    names and shapes the index records are the model's, and every rank's part of a sharded
    slot adds up to its parameter's shape. "" when it fits (or holds no optimizer)."""
    index_path = folder / f"{prefix}.json"
    if not index_path.is_file():
        return ""
    index = json.loads(index_path.read_text(encoding="utf-8"))
    params = shapes.optimizer
    layout = index.get("state", {}) if isinstance(index, dict) else {}
    for key in layout:
        if not (key.isdigit() and int(key) < len(params)):
            return (f"{prefix}.json: state of parameter {key!r}, but the model has "
                    f"{len(params)} parameters")
    if "files" not in index:
        for path, key, shape in _headers([folder / f"{prefix}.safetensors"]):
            number, _, slot = key.partition(".")
            if not (number.isdigit() and int(number) < len(params)):
                return f"{path.name}: tensor {key!r} is not the state of a model parameter"
            name, want = params[int(number)]
            if shape not in ((), want):
                return (f"{path.name}: tensor {key!r} ({slot} of {name}) has shape "
                        f"{_show(shape)} where the parameter has {_show(want)}")
        return ""
    recorded = index.get("params", {})
    for number, (name, want) in enumerate(params):
        entry = recorded.get(str(number), {})
        if entry.get("name") != name or tuple(entry.get("shape", ())) != want:
            return (f"{prefix}.json: parameter {number} is {entry.get('name')!r} of shape "
                    f"{_show(tuple(entry.get('shape', ())))} where the model has {name!r} of "
                    f"shape {_show(want)}")
    parts: dict[str, list[Shape]] = {}
    for path, key, shape in _headers([folder / f for f in index["files"]]):
        number, _, slot = key.partition(".")
        kind = layout.get(number, {}).get(slot)
        if kind is None:
            return f"{path.name}: tensor {key!r} is not in {prefix}.json's layout"
        name, want = params[int(number)]
        if kind == REPLICATED and shape not in ((), want):
            return (f"{path.name}: tensor {key!r} ({slot} of {name}) has shape {_show(shape)} "
                    f"where the parameter has {_show(want)}")
        if kind == SHARDED:
            if shape[1:] != want[1:] or not shape:
                return (f"{path.name}: tensor {key!r} ({slot} of {name}) has shape "
                        f"{_show(shape)}, not a part of the parameter's {_show(want)}")
            parts.setdefault(key, []).append(shape)
    for key, pieces in parts.items():
        name, want = params[int(key.split(".")[0])]
        rows = sum(p[0] for p in pieces)
        if rows != want[0] or len(pieces) != len(index["files"]):
            return (f"{prefix}-rank-*: the ranks' parts of {key!r} ({name}) have "
                    f"{rows} rows in {len(pieces)} file(s) where the parameter has {want[0]}")
    return ""
