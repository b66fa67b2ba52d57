"""The run folder's guards: one run at a time per ``output_dir``, and no writes through links.

``RunLock`` takes an exclusive ``fcntl.flock`` on ``<output_dir>/run.lock`` for as long as the
run lives. The operating system drops the lock when the process ends, however it ends (a crash,
SIGKILL), so a stale lock file never blocks the next run; the pid written into the file only
serves the message. ``no_follow`` is an ``opener`` for ``open`` that refuses to write through a
symbolic link, so a link planted at ``metrics.jsonl`` cannot redirect the run's writes; a
folder the run writes into (``checkpoints/``, ``tensorboard/``, ...) that is a link is refused
when the run takes its lock (``refuse_linked_folders``).

A write that fails (a full disk, a read-only folder, a quota) is an ``OSError`` that names no file
when it comes from ``write`` or ``close`` ("No space left on device"): ``writing`` turns it into
one ``RuntimeFailure`` naming the file being written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import attrs

from runner.errors import Problem, RecipeError, RuntimeFailure

LOCK_NAME = "run.lock"
# The folders a run (and ``eval``) writes into its output_dir; none may be a symbolic link.
RUN_FOLDERS = ("checkpoints", "tensorboard", "wandb", "mlruns", "eval")


@attrs.frozen
class RunFolder:
    """The layout of a run's ``output_dir``, written out once: what the run, ``eval``,
    ``export``, ``report`` and the trackers read and write there."""

    root: Path

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> RunFolder:
        """The run folder a checkpoint (``<root>/checkpoints/step-N``) belongs to."""
        return cls(checkpoint.parent.parent)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def resolved(self) -> Path:
        """The fully defaulted recipe (runner.recipe.resolved)."""
        return self.root / "recipe.resolved.toml"

    @property
    def report(self) -> Path:
        """Where ``posttrain-run report`` writes by default."""
        return self.root / "report.html"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME

    def eval(self, label: str) -> Path:
        """Where ``posttrain-run eval`` of checkpoint ``label`` writes."""
        return self.root / "eval" / label

    def tracker(self, name: str) -> Path:
        """A tracker's own folder: ``tensorboard``, ``wandb`` or ``mlruns``."""
        assert name in RUN_FOLDERS, name
        return self.root / name


def no_follow(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open`` with ``O_NOFOLLOW``; a link at ``path`` is an OSError saying so."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "it is a symbolic link, and the run never writes through "
                          "one", os.fspath(path)) from None
        raise


def linked_folder(output_dir: Path, names: tuple[str, ...] = RUN_FOLDERS) -> Path | None:
    """The first of ``output_dir``'s folders ``names`` (each a relative path, every part of it
    checked) that is a symbolic link, or None. The run writes into these folders through
    ``mkdir`` and libraries (TensorBoard, W&B) that follow links, so a link planted there
    would take the writes, and checkpoint rotation's deletions, outside the run folder."""
    for name in names:
        path = output_dir
        for part in Path(name).parts:
            path = path / part
            if path.is_symlink():
                return path
    return None


def refuse_linked_folders(output_dir: Path, names: tuple[str, ...] = RUN_FOLDERS,
                          key: str = "run.output_dir", source: str = "") -> None:
    """A RecipeError naming the first folder of ``linked_folder`` that is a link."""
    link = linked_folder(output_dir, names)
    if link is not None:
        raise RecipeError([Problem(
            key, f"{link} is a symbolic link, and the run never writes through one",
            hint="remove the link (a real folder in its place is fine), or choose another "
            "run.output_dir", source=source)])


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (created or truncated), never through a symbolic link."""
    with open(path, "w", encoding="utf-8", opener=no_follow) as handle:
        handle.write(text)


@contextlib.contextmanager
def writing(what: str, path: Path, *, role: str = "policy", step: int | None = None
            ) -> Iterator[None]:
    """Turn an ``OSError`` inside the block into ``RuntimeFailure``: ``role at step N: cannot
    write <what> <path>: <reason> [errno N]`` (the file the error names, when another)."""
    try:
        yield
    except OSError as exc:
        other = f" ({exc.filename})" if exc.filename and exc.filename != str(path) else ""
        raise RuntimeFailure(role, step, f"cannot write {what} {path}: "
                             f"{exc.strerror or exc} [errno {exc.errno}]{other}") from exc


class RunLock:
    """An exclusive lock on a run folder, held until ``release`` (or the process ends)."""

    def __init__(self, handle: IO[str], path: Path) -> None:
        self._handle: IO[str] | None = handle
        self.path = path

    @classmethod
    def acquire(cls, output_dir: Path) -> RunLock:
        """Lock ``output_dir`` (created if needed); a RecipeError naming ``run.output_dir`` and
        the holder's pid when another live run holds it."""
        output_dir.mkdir(parents=True, exist_ok=True)
        refuse_linked_folders(output_dir)
        path = RunFolder(output_dir).lock
        handle = open(path, "a+", encoding="utf-8", opener=no_follow)  # noqa: SIM115 - held
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.seek(0)
            holder = handle.read(32).strip()
            handle.close()
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise RecipeError([Problem(
                "run.output_dir", f"another run{who} is using {output_dir}: it holds {path}",
                hint="wait for it to finish, stop it, or choose another run.output_dir")]) from None
        try:
            with writing("the run lock", path):
                handle.seek(0)
                handle.truncate()
                handle.write(f"{os.getpid()}\n")
                handle.flush()
        except RuntimeFailure:
            handle.close()
            raise
        return cls(handle, path)

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor drops the lock
            self._handle = None


# Weight files a folder may hold that only torch.load reads (it unpickles them).
PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def pickled_weights(folder: Path) -> list[str]:
    """Names of the pickled weight files of a folder that holds no safetensors weights (a
    folder with ``model.safetensors`` or a sharded index loads those and nothing else)."""
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json")):
        return []
    return sorted(p.name for p in folder.iterdir()
                  if p.is_file() and p.name.endswith(PICKLED_WEIGHTS + (".bin.index.json",)))
