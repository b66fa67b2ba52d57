"""Writing checkpoints atomically (the layout: runner.state.layout): written to a temporary
folder, then renamed into place.

Each trained module comes as a ``ModuleState``: whole (``WholeState``, written from the module
and its optimizer) or sharded (``ShardedState``, its tensors gathered from the ranks and every
rank's optimizer shard staged beside the checkpoints).

A crash at any point leaves earlier checkpoints untouched; a half-written one stays under a
``.tmp-`` name that resume ignores and the next save removes. A write that fails (a full disk,
a read-only folder) removes its temporary folder and raises ``RuntimeFailure`` naming the step
and the path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from runner.errors import RuntimeFailure
from runner.state import integrity
from runner.state.layout import (
    COMPLETE,
    EXTRA_DIR,
    LATEST,
    MODEL_DIR,
    TMP_PREFIX,
    TrainingState,
    capture_rng,
    checkpoint_step,
    complete_checkpoints,
    optimizer_prefix,
    optimizer_to_files,
    shard_file,
    step_dirname,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

WRITER_ROLE = "policy"  # the role that writes checkpoints (rank 0 of the policy)


@attrs.frozen(eq=False)
class WholeState:
    """A module written from itself: its own state dict, and ``optimizer``'s state."""

    module: torch.nn.Module  # the policy: a Hugging Face model (a PEFT one under LoRA)
    optimizer: torch.optim.Optimizer


@attrs.frozen(eq=False)
class ShardedState:
    """A sharded module (train.sharding = "fsdp") as its ranks made it for the writer:
    ``weights``, its whole tensors (gathered, kept by rank 0), written instead of the module's
    own state dict, and ``optimizer_files``, every rank's optimizer shard staged beside the
    checkpoints in rank order, moved in with their index (runner.train.roles.sharding)."""

    module: torch.nn.Module  # the policy's writes its folder (config) around ``weights``
    weights: dict[str, torch.Tensor]
    optimizer_index: dict[str, Any]
    optimizer_files: tuple[Path, ...]


ModuleState = WholeState | ShardedState  # one trained module's part of a checkpoint


def save_checkpoint(
    root: Path,
    step: int,
    *,
    policy: ModuleState,
    tokenizer: PreTrainedTokenizerBase | ProcessorMixin | None,
    state: TrainingState,
    metrics_rows: list[dict[str, Any]],
    extra: Mapping[str, ModuleState] | None = None,
    keep_last: int = 2,
    rng_per_rank: list[dict[str, Any]] | None = None,
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; returns its folder.

    ``policy`` is written with ``tokenizer`` as ``model/`` and its optimizer as ``optimizer``,
    each module of ``extra`` (PPO's critic) as ``extra_models/NAME/`` and ``optimizer-NAME``.
    ``rng_per_rank`` holds every rank's ``capture_rng()`` (default: this process's alone).
    """
    extra = extra or {}
    modules = {optimizer_prefix(): policy,
               **{optimizer_prefix(name): module for name, module in extra.items()}}
    staged = [f for m in modules.values() if isinstance(m, ShardedState)
              for f in m.optimizer_files]
    final = root / step_dirname(step)
    with _failing_cleanly(root, step, staged):
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root, keep=staged)
        tmp = _partial_dir(root, step)
        tmp.mkdir()
        _write_policy(tmp, policy, tokenizer)
        for name, module in extra.items():
            _write_extra(tmp, name, module)
        for prefix, module in modules.items():
            _write_optimizer(tmp, prefix, module)
        _write_run_state(tmp, state, rng_per_rank or [capture_rng()], metrics_rows)
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


# --- the parts of a checkpoint ------------------------------------------------------------------

def _write_policy(tmp: Path, policy: ModuleState,
                  tokenizer: PreTrainedTokenizerBase | ProcessorMixin | None) -> None:
    """The policy as a Hugging Face folder, the tokenizer's (or processor's) files beside it."""
    with _file(tmp / MODEL_DIR):
        if isinstance(policy, ShardedState):
            policy.module.save_pretrained(tmp / MODEL_DIR, state_dict=policy.weights,
                                          safe_serialization=True)
        else:
            policy.module.save_pretrained(tmp / MODEL_DIR, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / MODEL_DIR)


def _write_extra(tmp: Path, name: str, saved: ModuleState) -> None:
    """The weights of the extra module ``name`` as one safetensors file."""
    (tmp / EXTRA_DIR / name).mkdir(parents=True)
    weights = saved.weights if isinstance(saved, ShardedState) else saved.module.state_dict()
    with _file(out := tmp / EXTRA_DIR / name / "model.safetensors"):
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, out)


def _write_optimizer(tmp: Path, prefix: str, saved: ModuleState) -> None:
    """A module's optimizer as ``PREFIX.safetensors`` and ``PREFIX.json``, or, sharded, its
    ranks' staged shards moved in and their index."""
    if isinstance(saved, ShardedState):
        _move_shards(tmp, prefix, saved.optimizer_index, saved.optimizer_files)
        return
    meta, tensors = optimizer_to_files(saved.optimizer)
    with _file(tmp / f"{prefix}.safetensors"):
        save_file(tensors, tmp / f"{prefix}.safetensors")
    _write_json(tmp / f"{prefix}.json", meta)


def _move_shards(tmp: Path, prefix: str, index: dict[str, Any], staged: Sequence[Path]) -> None:
    """Every rank's staged optimizer shard moved into the checkpoint ``tmp`` under its name (in
    rank order), and the index listing them written as ``PREFIX.json``."""
    names = []
    for rank, shard in enumerate(staged):
        names.append(shard_file(prefix, rank, len(staged)))
        with _file(tmp / names[-1]):
            os.replace(shard, tmp / names[-1])
    _write_json(tmp / f"{prefix}.json", {**index, "files": names})


def _write_run_state(tmp: Path, state: TrainingState, rngs: list[dict[str, Any]],
                     metrics_rows: list[dict[str, Any]]) -> None:
    """Every rank's RNG states (the torch and CUDA ones as tensors, the rest in state.json),
    the training state and the metrics rows."""
    rng_tensors = {f"{kind}.{r}": _bytes_tensor(rng[kind]) for r, rng in enumerate(rngs)
                   for kind in ("torch", "cuda") if rng.get(kind) is not None}
    with _file(tmp / "rng.safetensors"):
        save_file(rng_tensors, tmp / "rng.safetensors")
    _write_json(tmp / "state.json", {**attrs.asdict(state), "rng": [
        {"python": rng["python"], "numpy": rng["numpy"]} for rng in rngs]})
    with _file(tmp / "metrics.jsonl"), open(tmp / "metrics.jsonl", "w", encoding="utf-8") as f:
        for row in metrics_rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _write_json(path: Path, value: Any) -> None:
    with _file(path):
        path.write_text(json.dumps(value, indent=1, sort_keys=True), encoding="utf-8")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- failed writes ------------------------------------------------------------------------------

def _partial_dir(root: Path, step: int) -> Path:
    """The temporary folder this process writes checkpoint ``step`` into."""
    return root / f"{TMP_PREFIX}{step_dirname(step)}-{os.getpid()}"


@contextlib.contextmanager
def _failing_cleanly(root: Path, step: int, staged: Sequence[Path]) -> Iterator[None]:
    """A failed write (full disk, read-only folder) becomes one ``RuntimeFailure`` naming the
    step, the checkpoint and the file of it being written; the temporary folder (and pointer)
    of this process, and the ranks' optimizer shards ``staged`` for it, are removed first."""
    try:
        yield
    except (OSError, SafetensorError, RuntimeError, _FileWriteError) as exc:
        partial_dir = _partial_dir(root, step)
        for partial in (partial_dir, root / f"{TMP_PREFIX}{LATEST}-{os.getpid()}", *staged):
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


# --- what is beside the checkpoints -------------------------------------------------------------

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
