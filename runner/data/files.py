"""Reading prompt rows from local files and hub datasets through ``datasets``.

A local path is a file (``.jsonl``/``.json``, ``.parquet``, ``.csv``) or a folder of such files
(one format per folder; ``datasets`` picks the split from file names like ``train.jsonl``,
``test.jsonl``; a folder without such names is one ``train`` split). A single file is one split
under whatever name ``split`` gives.

Text files (jsonl, json, csv) are checked first: invalid UTF-8 and a malformed jsonl line are
reported with the file and the line number an editor shows, an empty file is named as empty.
``datasets`` converts a local file to Arrow before reading it; that cache goes under the
project's cache folder, ``<POSTTRAIN_HOME>/datasets`` (default
``~/.cache/posttrain-runner/datasets``); one read of it runs at a time across processes, and
whatever a failed read left there is removed.

A hub name needs the network or the local ``datasets`` cache. Before asking the hub, the host is
probed once with a short timeout; when it does not answer, only the cache is tried, so a run
without network fails at once with the dataset named instead of retrying for half a minute.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import json
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from runner.errors import Problem, RecipeError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
TEXT_SUFFIXES = (".jsonl", ".json", ".csv")
PROBE_TIMEOUT_S = 3.0
BOM = "\ufeff"  # a UTF-8 byte order mark opening a file is skipped, by every reader


class DuplicateKey(ValueError):
    """A JSON object names one key twice (``json`` would silently keep the last)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads`` that refuses a key given twice."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name in out:
            raise DuplicateKey(name)
        out[name] = value
    return out


def local_files(path: str, *, key: str) -> tuple[str, list[Path]]:
    """The ``datasets`` builder and the data files of ``path`` (sorted), or a RecipeError."""
    root = Path(path)
    supported = ", ".join(sorted(BUILDERS))
    if root.is_file():
        builder = BUILDERS.get(root.suffix.lower())
        if builder is None:
            raise RecipeError([Problem(key, f"unsupported file type {root.suffix or '(none)'!r}",
                                       got=path, hint=f"use one of {supported}")])
        return builder, [root]
    if not root.is_dir():
        raise RecipeError([Problem(key, "no such file or folder", got=path,
                                   hint="paths are relative to the working directory")])
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS)
    builders = {BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) != 1:
        found = "no data files" if not builders else f"mixed formats {sorted(builders)}"
        raise RecipeError([Problem(key, f"the folder holds {found}", got=path,
                                   hint=f"put files of one type ({supported}) in the folder")])
    return builders.pop(), files


def digest_files(root: str, files: list[Path]) -> tuple[int, str]:
    """Total size in bytes and sha256 over (relative name, content) of every data file."""
    digest, total, base = hashlib.sha256(), 0, Path(root)
    for file in files:
        name = file.name if file == base else str(file.relative_to(base))
        digest.update(name.encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
                total += len(chunk)
        digest.update(b"\0")
    return total, digest.hexdigest()


def load_local(path: str, split: str, *, key: str, split_key: str) -> tuple[Any, dict[str, str]]:
    """A ``datasets.Dataset`` of ``split`` of ``path``, and its identity parts.

    The parts are the path as written, the total size and the content sha256 of its data files.
    """
    builder, files = local_files(path, key=key)
    for file in files:
        if file.suffix.lower() in TEXT_SUFFIXES:
            check_text_file(file, key=key)
        if file.suffix.lower() == ".csv":
            check_csv_file(file, key=key)
    size, sha = digest_files(path, files)
    import datasets

    cache = arrow_cache_dir()
    with _cache_use(cache) as before:
        try:
            if len(files) == 1 and Path(path).is_file():
                ds = datasets.load_dataset(builder, data_files={split: str(files[0])},
                                           split=split, cache_dir=str(cache))
            else:
                ds = datasets.load_dataset(builder, data_dir=path, split=split,
                                           cache_dir=str(cache))
        except ValueError as exc:
            _remove_new(cache, before)
            if "split" in str(exc).lower():
                raise RecipeError([Problem(split_key, f"{path}: {exc}", got=split)]) from exc
            raise _unreadable(key, path, files, exc) from exc
        except Exception as exc:  # noqa: BLE001 - datasets raises many kinds on a bad file
            _remove_new(cache, before)
            full = _storage_error(exc)
            if full:
                from runner.errors import RuntimeFailure

                raise RuntimeFailure("data", None, f"{key}: cannot write the Arrow copy of "
                                     f"{path} under {cache}: {full}; free space there, or set "
                                     "POSTTRAIN_HOME to a folder on another disk") from exc
            raise _unreadable(key, path, files, exc) from exc
    return ds, {"path": path, "file_size": str(size), "content_sha256": sha, "split": split}


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # the cache, not the data, failed


def _storage_error(exc: BaseException | None) -> str:
    """``"<reason> [errno N]"`` of a full-disk (quota, read-only) OSError in ``exc``'s chain, or
    "": datasets wraps it in errors of its own, and Arrow's carries the errno only in its text."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            if exc.errno in STORAGE_ERRNOS:
                return f"{exc.strerror or exc} [errno {exc.errno}]"
            for code in STORAGE_ERRNOS:
                if os.strerror(code) in str(exc):
                    return f"{os.strerror(code)} [errno {code}]"
        exc = exc.__cause__ or exc.__context__
    return ""


def arrow_cache_dir() -> Path:
    """Where ``datasets`` keeps the Arrow copies of local data files: ``<home>/datasets``."""
    from runner.cache import home

    return home() / "datasets"


def _entries(folder: Path) -> set[Path]:
    return set(folder.rglob("*")) if folder.is_dir() else set()


_CACHE_LOCK = ".posttrain-readers.lock"


@contextlib.contextmanager
def _cache_use(folder: Path) -> Iterator[set[Path]]:
    """One read of ``folder`` at a time across processes (ranks of a run, other runs), under a
    lock the OS drops with a dead process; yields what the folder held before, so a failed
    read removes its own leftovers only, never files another read is writing."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / _CACHE_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield _entries(folder)


def _remove_new(folder: Path, before: set[Path]) -> None:
    """Remove what a failed read added to the cache (partial Arrow files, lock files)."""
    _remove_entries(folder, before | {folder / _CACHE_LOCK})


def _remove_entries(folder: Path, before: set[Path]) -> None:
    for entry in sorted(_entries(folder) - before, key=lambda p: len(p.parts)):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def check_text_file(file: Path, *, key: str) -> None:
    """Refuse a text data file that is not UTF-8 (naming the line an editor shows, counted
    from 1) or that holds nothing but blank lines."""
    content = False
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecipeError([Problem(key, f"{file} line {number}: not valid UTF-8 "
                                           f"({exc.reason} at byte {exc.start + 1} of the line)",
                                           hint="save the file as UTF-8")]) from None
            content = content or bool(raw.strip())
    if not content:
        raise RecipeError([Problem(key, f"{file} is empty", hint="give a file with data rows")])


def check_csv_file(file: Path, *, key: str) -> None:
    """Refuse a CSV file that ``datasets`` (pandas) would read wrongly instead of refusing: a
    row with more or fewer fields than the header (pandas shifts the columns, or fills the
    missing ones with nulls), an unterminated quote, or a last row without its line break (the
    file may be cut inside that row). Lines are numbered as an editor shows them."""
    with file.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle, strict=True)
        header: list[str] | None = None
        try:
            for row in reader:
                if not row:
                    continue
                if header is None:
                    header = row
                elif len(row) != len(header):
                    raise RecipeError([Problem(key, f"{file} line {reader.line_num}: the row has "
                                               f"{len(row)} fields where the header has "
                                               f"{len(header)}", hint="give every row one "
                                               "field per header column (quote fields that "
                                               "hold commas)")])
        except csv.Error as exc:
            raise RecipeError([Problem(key, f"{file} line {reader.line_num}: not valid CSV "
                                       f"({exc})", hint="close every quoted field")]) from None
    with file.open("rb") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) not in (b"\n", b"\r"):
            raise RecipeError([Problem(key, f"{file} line {reader.line_num}: the last row does not "
                                       "end with a line break, so the file may be cut inside it",
                                       hint="end the file with a line break if it is complete")])


def first_bad_jsonl_line(file: Path) -> str:
    """``"<file> line N: ..."`` for the first line that is not valid JSON, or ""."""
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                return f"{file} line {number}: not valid JSON ({exc.msg} at column {exc.colno})"
            except RecursionError:
                return f"{file} line {number}: JSON nested too deeply"
    return ""


def _unreadable(key: str, path: str, files: list[Path], exc: Exception) -> RecipeError:
    for file in files:
        if file.suffix.lower() == ".jsonl":
            where = first_bad_jsonl_line(file)
            if where:
                return RecipeError([Problem(key, where, hint="write one JSON object per line")])
    cause = exc.__cause__ or exc
    return RecipeError([Problem(key, f"datasets could not read {path}: {type(cause).__name__}: "
                                f"{str(cause)[:300]}",
                                hint="check the file is valid for its type")])


def load_hub(name: str, config: str, revision: str, split: str, *, key: str) -> Any:
    """The ``split`` of hub dataset ``name``; fails fast with the name when it cannot be had."""
    import datasets
    import datasets.config

    label = name + (f" (config {config!r})" if config else "") + (
        f" at revision {revision!r}" if revision else "")
    args: dict[str, Any] = {"split": split}
    if config:
        args["name"] = config
    if revision:
        args["revision"] = revision
    offline_set = bool(datasets.config.HF_HUB_OFFLINE)
    unreachable = None if offline_set else hub_unreachable()
    try:
        if offline_set or unreachable:
            with _offline():
                return datasets.load_dataset(name, **args)
        return datasets.load_dataset(name, **args)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; all mean "not loadable"
        if offline_set:
            why = "it is not in the local datasets cache and offline mode is set (HF_HUB_OFFLINE)"
        elif unreachable:
            why = f"the hub cannot be reached ({unreachable}) and it is not in the local cache"
        else:
            why = f"{type(exc).__name__}: {str(exc)[:300]}"
        raise RecipeError([Problem(key, f"cannot load hub dataset {label}: {why}",
                                   hint="download it once where the network is available, or "
                                   "save it to a local file and set data.path instead")]) from exc


def hub_unreachable(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the hub (or the HTTPS proxy) opens within ``timeout``;
    otherwise why not. Runs in a thread so a hanging name lookup cannot stall the caller."""
    from huggingface_hub import constants

    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or constants.ENDPOINT)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[str] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append("")
        except OSError as exc:
            outcome.append(f"{host}:{port}: {exc}")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if not outcome:
        return f"{host}:{port}: no answer within {timeout:.0f} s"
    return outcome[0] or None


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Cache-only ``datasets`` and ``huggingface_hub`` for the duration (their flags are
    module constants read at call time)."""
    import datasets.config
    from huggingface_hub import constants

    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE,
             constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE,
         constants.HF_HUB_OFFLINE) = saved
