"""Reading checkpoints (runner.state.layout): the newest intact one, every part parsed and
checked before anything of the run is set up.

Resume verifies the newest checkpoint against its manifest and falls back to the newest intact
one, saying which it skipped and why; one whose files are whole but do not parse (or whose
state.json names another step than its folder) is passed over the same way. Nothing is
unpickled: tensors come from safetensors, everything else from JSON.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from runner.errors import RuntimeFailure
from runner.state import integrity
from runner.state.layout import (
    COMPLETE,
    EXTRA_DIR,
    LATEST,
    MODEL_DIR,
    TrainingState,
    checkpoint_step,
    optimizer_from_files,
    optimizer_prefix,
    shard_file,
)

_log = logging.getLogger(__name__)

# Every rank's Python and numpy RNG states as state.json records them (one dict: written by one
# process, before ranks existed).
RngStates = list[dict[str, Any]] | dict[str, Any]


def latest_checkpoint(root: Path, on_skip: Callable[[str], None] | None = None,
                      check: Callable[[Path], str] | None = None) -> Path | None:
    """The newest intact checkpoint: the folder named by ``latest`` when it verifies, else the
    newest complete one that does. None when there is no complete checkpoint at all.
    ``check(folder)`` may add a reason to pass over a folder that verifies ("" to take it).

    Each newer checkpoint passed over is reported through ``on_skip`` (default: a warning on
    the ``runner.state.load`` logger). When complete checkpoints exist but none is intact,
    raises ``RuntimeFailure`` rather than letting the run start over silently.
    """
    found, skipped, total = integrity.find_intact(root, LATEST, COMPLETE, check)
    for skip in skipped:
        (on_skip or _log.warning)(skip.message())
    if found is None and total:
        reasons = "; ".join(f"{s.path.name}: {s.reason}" for s in skipped)
        raise RuntimeFailure("resume", None, f"no intact checkpoint in {root} ({reasons}); "
                             "set checkpoint.resume = 'never' or choose another run.output_dir "
                             "to start over")
    return found


def load_latest(root: Path, on_skip: Callable[[str], None] | None = None,
                fits: Callable[[LoadedCheckpoint], str] | None = None
                ) -> LoadedCheckpoint | None:
    """The newest checkpoint that is intact and loads: one that verifies but does not parse is
    reported (``cannot load checkpoint ...: what``) and passed over like a damaged one, and so
    is one for which ``fits(loaded)`` gives a reason (runner.state.fit: a tensor whose name or
    shape is not the model's)."""
    loaded: dict[Path, LoadedCheckpoint] = {}

    def loads(folder: Path) -> str:
        try:
            loaded[folder] = load_checkpoint(folder)
        except CheckpointUnreadable as exc:
            return exc.what
        return fits(loaded[folder]) if fits is not None else ""

    path = latest_checkpoint(root, on_skip, check=loads)
    return loaded[path] if path is not None else None


@attrs.frozen
class LoadedCheckpoint:
    path: Path
    state: TrainingState
    rng: RngStates
    rng_tensors: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    metrics_rows: list[dict[str, Any]]

    @property
    def model_dir(self) -> Path:
        return self.path / MODEL_DIR

    def rng_of_rank(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s Python/numpy RNG state (a rank the writer did not have takes rank 0's:
        another world size is not bitwise anyway)."""
        if isinstance(self.rng, dict):  # written by one process before ranks existed
            return self.rng
        return self.rng[rank if rank < len(self.rng) else 0]

    def rng_tensors_of_rank(self, rank: int) -> dict[str, torch.Tensor]:
        if "torch" in self.rng_tensors:
            return self.rng_tensors
        r = rank if f"torch.{rank}" in self.rng_tensors else 0
        return {kind: t for kind in ("torch", "cuda")
                if (t := self.rng_tensors.get(f"{kind}.{r}")) is not None}

    def extra_state(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(self.path / EXTRA_DIR / name / "model.safetensors")

    def extra_optimizer_state(self, name: str) -> dict[str, Any]:
        return _load_optimizer(self.path, optimizer_prefix(name))


def _load_optimizer(path: Path, prefix: str) -> dict[str, Any]:
    """An optimizer's whole state; for per-rank shards (``files`` in its JSON) the index alone,
    as ``{"sharded": index, "folder": path}``, every shard's header checked (each rank reads its
    own when its optimizer is built)."""
    meta = json.loads((path / f"{prefix}.json").read_text())
    if isinstance(meta, dict) and "files" in meta:
        files = meta["files"]
        if not (isinstance(files, list) and files and all(
                isinstance(f, str) and f == shard_file(prefix, r, len(files))
                for r, f in enumerate(files))):
            raise ValueError(f"{prefix}.json: 'files' does not list the per-rank shards")
        for name in files:
            with safe_open(path / name, "pt") as handle:
                list(handle.keys())
        return {"sharded": meta, "folder": path}
    return optimizer_from_files(meta, load_file(path / f"{prefix}.safetensors"))


class CheckpointUnreadable(RuntimeFailure):
    """A checkpoint whose files are whole (they match their manifest, or it predates manifests)
    but do not parse as a checkpoint: ``what`` says which file and why."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        super().__init__("resume", None, f"cannot load checkpoint {path}: {what}")


# What parsing a file that is whole but wrong raises (json, safetensors, torch, numpy, random).
_PARSE_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError,
                 OverflowError, RuntimeError, SafetensorError)


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """The checkpoint at ``path``, every part parsed and checked (state.json's fields, every
    rank's RNG state, the optimizer, the headers of the weight files); anything that does not
    parse raises ``CheckpointUnreadable``."""
    current = "state.json"
    try:
        raw = json.loads((path / "state.json").read_text(encoding="utf-8"))
        rng, state = _state(path, raw)
        current = "optimizer.safetensors / optimizer.json"
        optimizer_state = _load_optimizer(path, optimizer_prefix())
        current = "rng.safetensors"
        rng_tensors = load_file(path / "rng.safetensors")
        current = "the RNG states (state.json 'rng', rng.safetensors)"
        _check_rng(rng, rng_tensors)
        current = "metrics.jsonl"
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()
                if line]
        if not all(isinstance(row, dict) for row in rows):
            raise ValueError("a row is not a JSON object")
        current = "the weight files"
        for weights in sorted(path.glob(f"{MODEL_DIR}/*.safetensors")) + sorted(
                path.glob(f"{EXTRA_DIR}/*/*.safetensors")):
            current = weights.relative_to(path).as_posix()
            with safe_open(weights, "pt") as handle:
                list(handle.keys())
        for config in sorted(path.glob(f"{MODEL_DIR}/*.json")):
            current = config.relative_to(path).as_posix()
            json.loads(config.read_text(encoding="utf-8"))
    except CheckpointUnreadable:
        raise
    except _PARSE_ERRORS as exc:
        raise CheckpointUnreadable(path, f"{current}: {type(exc).__name__}: {exc}") from exc
    return LoadedCheckpoint(path, state, rng, rng_tensors, optimizer_state, rows)


def _state(path: Path, raw: object) -> tuple[RngStates, TrainingState]:
    """The RNG part and the TrainingState of a parsed state.json, its fields checked."""
    if not isinstance(raw, dict):
        raise CheckpointUnreadable(path, f"state.json holds a {type(raw).__name__}, not an object")
    raw = dict(raw)
    rng = raw.pop("rng", None)
    state = TrainingState(**raw)
    wrong = [name for name, value, kinds in (
        ("step", state.step, int), ("world_size", state.world_size, int),
        ("cursor", state.cursor, dict | None), ("scheduler", state.scheduler, dict),
        ("extra", state.extra, dict), ("items_per_step", state.items_per_step, int | None),
        ("trackers", state.trackers, dict), ("in_flight", state.in_flight, list),
        ("off_policy_steps", state.off_policy_steps, int | None))
        if isinstance(value, bool) or not isinstance(value, kinds)]
    if not wrong and not all(isinstance(v, str) for v in state.trackers.values()):
        wrong = ["trackers"]
    if wrong:
        name = wrong[0]
        raise CheckpointUnreadable(path, f"state.json: {name!r} is "
                                   f"{json.dumps(getattr(state, name))[:40]}, not of the type "
                                   "a checkpoint records")
    if state.step < 0 or state.world_size < 1:
        raise CheckpointUnreadable(path, f"state.json: step {state.step} / world_size "
                                   f"{state.world_size} out of range")
    if integrity.STEP_NAME.fullmatch(path.name) and checkpoint_step(path) != state.step:
        raise CheckpointUnreadable(path, f"its state.json records step {state.step} but the "
                                   f"folder is named {path.name} (renamed or copied?)")
    if not isinstance(rng, list | dict):
        raise CheckpointUnreadable(path, "state.json: 'rng' is missing or not a list")
    return rng, state


def _check_rng(rng: RngStates, tensors: dict[str, torch.Tensor]) -> None:
    """Apply every saved RNG state to fresh generators: what would fail on restore fails here,
    before anything of the run is set up (and the process's own generators are untouched)."""
    for entry in [rng] if isinstance(rng, dict) else rng:
        version, internal, gauss = entry["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = entry["numpy"]
        np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos,
                                           has_gauss, cached))
    for name, tensor in tensors.items():
        if name.split(".")[0] == "torch":
            torch.Generator().set_state(tensor)
