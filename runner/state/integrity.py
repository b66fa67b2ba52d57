"""Checkpoint integrity: a manifest of every file's size and sha256, written with the checkpoint
and verified before a run resumes from it.

``MANIFEST.json`` lists every file of the checkpoint folder except itself and ``COMPLETE``, and
carries a checksum of its own content, so a damaged manifest is told apart from a damaged file.
``find_intact`` walks the checkpoints newest first and returns the first that verifies, with the
reason each newer one was skipped. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

MANIFEST = "MANIFEST.json"
MANIFEST_VERSION = 1
STEP_NAME = re.compile(r"step-\d{6,}")
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _self_digest(step: int, files: dict[str, Any]) -> str:
    text = json.dumps({"step": step, "files": files}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(folder: Path, step: int, skip: tuple[str, ...] = ()) -> Path:
    """Record size and sha256 of every file under ``folder`` (but ``skip`` and the manifest)."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST or rel in skip:
            continue
        files[rel] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    doc = {"version": MANIFEST_VERSION, "step": step, "files": files,
           "sha256": _self_digest(step, files)}
    out = folder / MANIFEST
    out.write_text(json.dumps(doc, indent=1, sort_keys=True), encoding="utf-8")
    return out


def _read_manifest(folder: Path) -> tuple[dict[str, Any] | None, str]:
    path = folder / MANIFEST
    if not path.is_file():
        return None, f"{MANIFEST} is missing (written by an older version, or deleted)"
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
        files, step = doc["files"], doc["step"]
        ok = isinstance(files, dict) and doc["sha256"] == _self_digest(step, files)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        return None, f"{MANIFEST} is damaged"
    return doc, ""


def written_before_manifests(folder: Path) -> bool:
    """A checkpoint of a version that wrote no manifest: its state.json lacks ``world_size``
    (written by every version that writes manifests)."""
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and "step" in state and "world_size" not in state


def recorded_step(folder: Path) -> int | None:
    """The step a checkpoint's state.json records, or None when it has none that is readable."""
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    step = state.get("step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def verify(folder: Path) -> str:
    """Why ``folder`` is not an intact checkpoint, or "" when every file matches its manifest
    (or it was written by a version before manifests, which resume takes unverified)."""
    doc, why = _read_manifest(folder)
    if doc is None:
        if not (folder / MANIFEST).exists() and written_before_manifests(folder):
            return ""
        return why
    for rel, entry in sorted(doc["files"].items()):
        path = folder / rel
        try:
            size = path.stat().st_size if path.is_file() else None
            if size is None:
                return f"{rel} is missing"
            if size != entry.get("size"):
                return f"{rel} has {size} bytes where the manifest records {entry.get('size')}"
            if file_sha256(path) != entry.get("sha256"):
                return f"{rel} does not match its recorded sha256"
        except (OSError, AttributeError) as exc:
            return f"{rel} cannot be read ({exc})"
    return ""


@attrs.frozen
class Skipped:
    """A checkpoint folder passed over on resume, and why."""

    path: Path
    reason: str
    unloadable: bool = False  # whole files that do not parse (the ``check`` of find_intact)

    def message(self) -> str:
        if self.unloadable:
            return f"cannot load checkpoint {self.path}: {self.reason}; skipping it"
        return f"skipping checkpoint {self.path}: {self.reason}"


def step_folders(root: Path) -> list[Path]:
    """Folders named like a checkpoint (``step-NNNNNN``), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def read_pointer(root: Path, pointer: str) -> Path | None:
    """The checkpoint folder the ``pointer`` file names, if it names one (any bytes accepted)."""
    path = root / pointer
    try:
        text = path.read_bytes().decode("utf-8", errors="replace").strip()
    except OSError:
        return None
    return root / text if STEP_NAME.fullmatch(text) else None


def find_intact(root: Path, pointer: str, complete: str,
                check: Callable[[Path], str] | None = None
                ) -> tuple[Path | None, list[Skipped], int]:
    """The newest intact checkpoint (the pointer's first), the newer ones skipped, and how many
    complete checkpoints exist in all.

    A folder without the ``complete`` marker is an interrupted write or deletion: it is skipped
    (and reported when newer than the one chosen) but does not count as a checkpoint. A folder
    that verifies is taken unless ``check(folder)`` gives a reason not to.
    """
    folders = step_folders(root)
    named = read_pointer(root, pointer)
    order = ([named] if named in folders else []) + [p for p in reversed(folders) if p != named]
    skipped: list[Skipped] = []
    total = sum((p / complete).is_file() for p in folders)
    for folder in order:
        if not (folder / complete).is_file():
            skipped.append(Skipped(folder, f"no {complete} marker (an interrupted write or "
                                           "deletion)"))
            continue
        why = verify(folder)
        unloadable = not why and check is not None and bool(why := check(folder))
        if not why:
            return folder, skipped, total
        skipped.append(Skipped(folder, why, unloadable))
    return None, skipped, total
