"""Atomic checkpoints: written to a temporary folder, then renamed into place.

Layout of ``<output_dir>/checkpoints/``::

    step-000020/            one complete checkpoint
      model/                the policy as a Hugging Face folder (safetensors) + tokenizer files
      extra_models/NAME/    other trained modules (e.g. the PPO critic), safetensors
      optimizer.safetensors optimizer tensors;   optimizer.json  its param groups and layout
      optimizer-rank-RRRRR-of-WWWWW.safetensors   instead, under train.sharding = "fsdp": each
                            rank's optimizer shards; optimizer.json then also lists the files,
                            the parameters' names and global shapes (runner.train.roles.sharding)
      optimizer-NAME.*      optimizers of the extra modules; under fsdp a sharded extra module
                            (PPO's critic) is gathered into extra_models/NAME/ like the policy,
                            and its optimizer written per rank as
                            optimizer-NAME-rank-RRRRR-of-WWWWW.safetensors + optimizer-NAME.json
      rng.safetensors       every rank's torch (and CUDA) RNG state, ``torch.R`` / ``cuda.R``
      state.json            step, cursor, scheduler, world size and global batch, every rank's
                            python/numpy RNG state, the tracker run ids (W&B, MLflow)
      metrics.jsonl         the metrics rows written up to this step
      MANIFEST.json         size and sha256 of every file above (runner.state.integrity)
      COMPLETE              written last, inside the temporary folder, before the rename
    latest                  name of the newest complete checkpoint (replaced atomically)

Loading never unpickles: tensors come from safetensors, everything else from JSON.
A crash at any point leaves earlier checkpoints untouched; a half-written one stays under a
``.tmp-`` name that resume ignores and the next save removes. A write that fails (a full disk,
a read-only folder) removes its temporary folder and raises ``RuntimeFailure`` naming the step
and the path. Resume verifies the newest checkpoint against its manifest and falls back to the
newest intact one, saying which it skipped and why; one whose files are whole but do not parse
(or whose state.json names another step than its folder) is passed over the same way.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from runner.errors import RuntimeFailure
from runner.state import integrity

COMPLETE = "COMPLETE"
MODEL_DIR = "model"  # a checkpoint's model folder: a Hugging Face folder (or LoRA adapters)
SHARD_FILE = "optimizer-rank-{rank:05d}-of-{world:05d}.safetensors"  # train.sharding = "fsdp"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
WRITER_ROLE = "policy"  # the role that writes checkpoints (rank 0 of the policy)
_log = logging.getLogger(__name__)


def shard_file(prefix: str, rank: int, world: int) -> str:
    """The name of rank ``rank``'s optimizer shard of the optimizer saved as ``prefix``
    (``optimizer``: the policy's, ``SHARD_FILE``; ``optimizer-NAME``: an extra module's)."""
    return f"{prefix}-rank-{rank:05d}-of-{world:05d}.safetensors"


def step_dirname(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_step(folder: Path) -> int:
    """The step of a checkpoint folder named by ``step_dirname``."""
    return int(folder.name.split("-")[1])


@attrs.frozen
class TrainingState:
    """Everything besides module weights that a resumed run needs, as JSON-able values."""

    step: int
    cursor: dict[str, Any] | None
    scheduler: dict[str, Any]
    extra: dict[str, Any] = attrs.field(factory=dict)
    world_size: int = 1  # ranks that wrote it
    items_per_step: int | None = None  # the global batch (prompts or pairs) it was trained with
    trackers: dict[str, str] = attrs.field(factory=dict)  # tracker -> the run id a resume continues
    # per rank, the batches sampled ahead and not yet trained (algo.max_off_policy_steps >= 1)
    in_flight: list[Any] = attrs.field(factory=list)
    # the algo.max_off_policy_steps they were sampled with (None: written before it was kept)
    off_policy_steps: int | None = None


# --- RNG ----------------------------------------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """This process's RNG states as plain data (it travels between ranks before a save)."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    cuda = (torch.cuda.get_rng_state().numpy().tobytes()
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "torch": torch.get_rng_state().numpy().tobytes(), "cuda": cuda}


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def restore_rng(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


# --- optimizer ----------------------------------------------------------------------------------

def optimizer_to_files(
    optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    sd = optimizer.state_dict()
    tensors, layout = {}, {}
    for index, slots in sd["state"].items():
        layout[str(index)] = {}
        for name, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
                layout[str(index)][name] = "tensor"
            else:
                layout[str(index)][name] = value
    return {"param_groups": sd["param_groups"], "state": layout}, tensors


def optimizer_from_files(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state = {}
    for index, slots in meta["state"].items():
        state[int(index)] = {name: tensors[f"{index}.{name}"] if value == "tensor" else value
                             for name, value in slots.items()}
    # JSON has no tuples: give back the tuples (e.g. AdamW's betas) the optimizer wrote.
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# --- save / load --------------------------------------------------------------------------------

def _write_json(path: Path, value: Any) -> None:
    with _file(path):
        path.write_text(json.dumps(value, indent=1, sort_keys=True), encoding="utf-8")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fail_cleanly(write: Callable[..., Path]) -> Callable[..., Path]:
    """A failed write (full disk, read-only folder) becomes one ``RuntimeFailure`` naming the
    step, the checkpoint and the file of it being written; the temporary folder (and pointer)
    of this process, and the ranks' optimizer shards staged for it, are removed first."""

    @functools.wraps(write)
    def wrapper(root: Path, step: int, **parts: Any) -> Path:
        try:
            return write(root, step, **parts)
        except (OSError, SafetensorError, RuntimeError, _FileWriteError) as exc:
            partial_dir = root / f"{TMP_PREFIX}{step_dirname(step)}-{os.getpid()}"
            for partial in (partial_dir, root / f"{TMP_PREFIX}{LATEST}-{os.getpid()}",
                            *_staged_files(parts)):
                if partial.is_dir():
                    shutil.rmtree(partial, ignore_errors=True)
                elif partial.exists():
                    partial.unlink(missing_ok=True)
            error, file = exc, None
            if isinstance(exc, _FileWriteError):
                error, file = exc.error, exc.path
            if isinstance(error, OSError) and error.filename:
                file = Path(error.filename)  # the OS named the file: more precise
            inside = file is not None and file.is_relative_to(partial_dir)
            where = (f" ({file.relative_to(partial_dir) if inside else file})"
                     if file is not None else "")
            raise RuntimeFailure(
                WRITER_ROLE, step, f"cannot write checkpoint {root / step_dirname(step)}{where}: "
                f"{describe_write_error(error)}; the partial checkpoint was removed and "
                "earlier checkpoints are untouched") from exc

    return wrapper


def _staged_files(parts: dict[str, Any]) -> list[Path]:
    """Every rank's optimizer shards staged for a checkpoint: the policy's and the extra
    modules'."""
    shards = [parts.get("optimizer_shards"), *(parts.get("extra_optimizer_shards") or {}).values()]
    return [f for s in shards if s is not None for f in s[1]]


class _FileWriteError(Exception):
    """Writing ``path`` (inside the temporary checkpoint folder) failed with ``error``."""

    def __init__(self, path: Path, error: BaseException) -> None:
        super().__init__(str(error))
        self.path, self.error = path, error


@contextlib.contextmanager
def _file(path: Path) -> Iterator[None]:
    """Name ``path`` in a write error raised inside: a full disk fails ``write`` or ``close``
    with an OSError that names no file, and safetensors with its own error."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        raise _FileWriteError(path, exc) from exc


def describe_write_error(exc: BaseException) -> str:
    """One line for a failed write: the OS reason (the caller names the file), or the error."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} [errno {exc.errno}]"
    return f"{type(exc).__name__}: {exc}"


@_fail_cleanly
def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    state: TrainingState,
    metrics_rows: list[dict[str, Any]],
    extra_modules: dict[str, torch.nn.Module] | None = None,
    extra_optimizers: dict[str, torch.optim.Optimizer] | None = None,
    keep_last: int = 2,
    rng_per_rank: list[dict[str, Any]] | None = None,
    model_state: dict[str, torch.Tensor] | None = None,
    optimizer_shards: tuple[dict[str, Any], list[Path]] | None = None,
    extra_states: dict[str, dict[str, torch.Tensor]] | None = None,
    extra_optimizer_shards: dict[str, tuple[dict[str, Any], list[Path]]] | None = None,
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; returns its folder.

    ``rng_per_rank`` holds every rank's ``capture_rng()`` (default: this process's alone).
    A sharded policy's writer gives ``model_state`` (the whole tensors, gathered) and
    ``optimizer_shards``: the optimizer's index and every rank's shard file, written beside the
    checkpoints under a temporary name and moved in here (in rank order), instead of
    ``optimizer``'s own state. A sharded extra module likewise: ``extra_states[NAME]`` (its
    whole tensors, instead of the module's state dict) and ``extra_optimizer_shards[NAME]``
    (instead of ``extra_optimizers[NAME]``).
    """
    root.mkdir(parents=True, exist_ok=True)
    extra_states, extra_shards = extra_states or {}, extra_optimizer_shards or {}
    _remove_stale(root, keep=_staged_files({"optimizer_shards": optimizer_shards,
                                            "extra_optimizer_shards": extra_shards}))
    final = root / step_dirname(step)
    tmp = root / f"{TMP_PREFIX}{step_dirname(step)}-{os.getpid()}"
    tmp.mkdir()
    with _file(tmp / MODEL_DIR):
        if model_state is None:
            model.save_pretrained(tmp / MODEL_DIR, safe_serialization=True)
        else:
            model.save_pretrained(tmp / MODEL_DIR, state_dict=model_state,
                                  safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / MODEL_DIR)
    for name, module in (extra_modules or {}).items():
        (tmp / "extra_models" / name).mkdir(parents=True)
        weights = extra_states[name] if name in extra_states else module.state_dict()
        with _file(out := tmp / "extra_models" / name / "model.safetensors"):
            save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, out)
    for prefix, shards in [("optimizer", optimizer_shards), *(
            (f"optimizer-{name}", s) for name, s in extra_shards.items())]:
        if shards is not None:
            _move_shards(tmp, prefix, *shards)
    own = [] if optimizer_shards is not None else [("optimizer", optimizer)]
    for prefix, opt in own + [(f"optimizer-{name}", o) for name, o in
                              (extra_optimizers or {}).items() if name not in extra_shards]:
        opt_meta, opt_tensors = optimizer_to_files(opt)
        with _file(tmp / f"{prefix}.safetensors"):
            save_file(opt_tensors, tmp / f"{prefix}.safetensors")
        _write_json(tmp / f"{prefix}.json", opt_meta)
    rngs = rng_per_rank or [capture_rng()]
    rng_tensors = {f"{kind}.{r}": _bytes_tensor(rng[kind]) for r, rng in enumerate(rngs)
                   for kind in ("torch", "cuda") if rng.get(kind) is not None}
    with _file(tmp / "rng.safetensors"):
        save_file(rng_tensors, tmp / "rng.safetensors")
    _write_json(tmp / "state.json", {**attrs.asdict(state), "rng": [
        {"python": rng["python"], "numpy": rng["numpy"]} for rng in rngs]})
    with _file(tmp / "metrics.jsonl"), open(tmp / "metrics.jsonl", "w", encoding="utf-8") as f:
        for row in metrics_rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    with _file(tmp / integrity.MANIFEST):
        integrity.write_manifest(tmp, step, skip=(COMPLETE,))
    with _file(tmp / COMPLETE):
        (tmp / COMPLETE).write_text(str(step))
    _fsync_dir(tmp)
    if final.exists():  # a checkpoint of this step from an earlier lineage: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _point_latest(root, final.name)
    _prune(root, keep_last)
    return final


def _move_shards(tmp: Path, prefix: str, index: dict[str, Any], staged: Sequence[Path]) -> None:
    """Every rank's staged optimizer shard moved into the checkpoint ``tmp`` under its name (in
    rank order), and the index listing them written as ``PREFIX.json``."""
    names = []
    for rank, shard in enumerate(staged):
        names.append(shard_file(prefix, rank, len(staged)))
        with _file(tmp / names[-1]):
            os.replace(shard, tmp / names[-1])
    _write_json(tmp / f"{prefix}.json", {**index, "files": names})


def _remove_stale(root: Path, keep: Sequence[Path] = ()) -> None:
    """Remove temporary folders left by writers that no longer run (the writer's pid ends the
    name): a folder another live process is writing is never touched, nor the files of
    ``keep`` (the ranks' optimizer shards staged for this checkpoint)."""
    for stale in root.glob(TMP_PREFIX + "*"):
        if stale in keep:
            continue
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
    with _file(root / LATEST):
        tmp.write_text(name)
        os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` checkpoints. Only folders whose name agrees with
    the step their state.json records count: a renamed or copied folder (``step-000099`` holding
    step 2) is neither counted nor removed, so it cannot push real checkpoints out."""
    real = [p for p in complete_checkpoints(root)
            if integrity.recorded_step(p) == checkpoint_step(p)]
    for old in real[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    return [p for p in integrity.step_folders(root) if (p / COMPLETE).is_file()]


def latest_checkpoint(root: Path, on_skip: Callable[[str], None] | None = None,
                      check: Callable[[Path], str] | None = None) -> Path | None:
    """The newest intact checkpoint: the folder named by ``latest`` when it verifies, else the
    newest complete one that does. None when there is no complete checkpoint at all.
    ``check(folder)`` may add a reason to pass over a folder that verifies ("" to take it).

    Each newer checkpoint passed over is reported through ``on_skip`` (default: a warning on
    the ``runner.state.checkpoint`` logger). When complete checkpoints exist but none is
    intact, raises ``RuntimeFailure`` rather than letting the run start over silently.
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
    rng: Any  # a list of per-rank states (a dict in single-process checkpoints of before)
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
        return load_file(self.path / "extra_models" / name / "model.safetensors")

    def extra_optimizer_state(self, name: str) -> dict[str, Any]:
        return _load_optimizer(self.path, f"optimizer-{name}")


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
        optimizer_state = _load_optimizer(path, "optimizer")
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
        for weights in sorted(path.glob("model/*.safetensors")) + sorted(
                path.glob("extra_models/*/*.safetensors")):
            current = weights.relative_to(path).as_posix()
            with safe_open(weights, "pt") as handle:
                list(handle.keys())
        for config in sorted(path.glob("model/*.json")):
            current = config.relative_to(path).as_posix()
            json.loads(config.read_text(encoding="utf-8"))
    except CheckpointUnreadable:
        raise
    except _PARSE_ERRORS as exc:
        raise CheckpointUnreadable(path, f"{current}: {type(exc).__name__}: {exc}") from exc
    return LoadedCheckpoint(path, state, rng, rng_tensors, optimizer_state, rows)


def _state(path: Path, raw: Any) -> tuple[Any, TrainingState]:
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


def _check_rng(rng: Any, tensors: dict[str, torch.Tensor]) -> None:
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
