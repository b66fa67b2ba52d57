"""Reading the ``.json`` samples of a tar archive to its proper end, or refusing it.

``tarfile`` stops iterating quietly at a damaged or missing header, so a cut or corrupted
archive would give only some of its samples. Here the header block that ended the iteration is
kept (tarfile reads each header as one 512-byte read) and must be the zero block that marks the
end of an archive; anything else refuses the archive, naming the offset and the last good
member. Compressed archives (gzip, bzip2, xz) are decompressed as a stream; one member at a
time is read into memory, at most ``max_member_bytes`` of it, and nothing is extracted to disk;
a compressed stream is read to its end so that its checksum is verified too. The whole stream,
decompressed, may hold at most ``max_total_bytes`` (``data.tar_max_bytes``): a small archive
that expands to gigabytes (a tar bomb) is refused once it passes that, not read to its end.
Members with absolute paths, ``..`` components, links or devices refuse the whole archive.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from runner.data.files import DuplicateKey, unique_keys
from runner.errors import Problem, RecipeError

BLOCK = tarfile.BLOCKSIZE
_MAGIC = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))
# What a damaged or cut archive raises while being read.
READ_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)


class TooBig(Exception):
    """The archive passed ``data.tar_max_bytes`` (decompressed)."""


class _LastRead:
    """A read-only stream that remembers what its last ``read`` returned, and refuses to go
    past ``limit`` bytes of (decompressed) stream: a seek forward over a skipped member of a
    compressed archive decompresses everything up to its target, so the target is checked
    before the seek."""

    def __init__(self, raw: BinaryIO, limit: int) -> None:
        self._raw = raw
        self.last = b""
        self.limit = limit

    def read(self, size: int = -1) -> bytes:
        position = self._raw.tell()
        if size < 0 or position + size > self.limit:
            size = max(0, self.limit - position) + 1  # one byte more tells "too big"
        self.last = self._raw.read(size)
        if position + len(self.last) > self.limit:
            raise TooBig
        return self.last

    def seek(self, pos: int, whence: int = 0) -> int:
        target = pos if whence == 0 else self._raw.tell() + pos if whence == 1 else None
        if target is not None and target > self.limit:
            raise TooBig
        return self._raw.seek(pos, whence)

    def tell(self) -> int:
        return self._raw.tell()


def _open_stream(file: Path) -> BinaryIO:
    with file.open("rb") as handle:
        head = handle.read(6)
    for magic, opener in _MAGIC:
        if head.startswith(magic):
            return opener(file, "rb")
    return file.open("rb")


def read_tar_samples(file: Path, key: str, max_member_bytes: int,
                     max_total_bytes: int = 2 * 2**30) -> list[tuple[str, Any]]:
    """``(where, parsed JSON)`` of every regular ``.json`` member, in member-name order."""
    try:
        return _read_samples(file, key, max_member_bytes, max_total_bytes)
    except TooBig:
        raise _refuse(key, file, f"decompresses to more than data.tar_max_bytes "
                      f"({max_total_bytes:,} bytes)", hint="raise data.tar_max_bytes if the "
                      "archive is meant to be that big") from None


def _read_samples(file: Path, key: str, max_member_bytes: int, max_total_bytes: int
                  ) -> list[tuple[str, Any]]:
    stream = _open_stream(file)
    tracked = _LastRead(stream, max_total_bytes)
    try:
        archive = tarfile.open(fileobj=tracked, mode="r:")  # type: ignore[call-overload]
    except READ_ERRORS as exc:
        stream.close()
        raise _refuse(key, file, f"is not a readable tar archive ({_why(exc)})") from None
    samples: list[tuple[str, Any]] = []
    last = ""
    with stream, archive:
        while True:
            try:
                member = archive.next()
            except READ_ERRORS as exc:
                raise _refuse(key, file, f"is damaged at offset {archive.offset}{_after(last)} "
                              f"({_why(exc)})") from None
            if member is None:
                break
            _check_safe(member, key, file)
            if member.isfile() and member.name.endswith(".json"):
                data = _read_member(archive, member, key, file, max_member_bytes)
                samples.append((f"member {member.name!r}", _parse(data, member.name, key, file)))
            last = member.name
        _check_end(tracked.last, archive.offset, last, key, file)
        if not isinstance(stream, io.BufferedReader):  # a decompressing stream
            _drain(tracked, key, file)
    return sorted(samples, key=lambda s: s[0])


def _drain(stream: _LastRead, key: str, file: Path) -> None:
    """Read a compressed stream to its end, so its own checksum and length are verified."""
    try:
        while stream.read(1 << 20):
            pass
    except READ_ERRORS as exc:
        raise _refuse(key, file, "has a damaged compressed stream after the end-of-archive "
                      f"marker ({_why(exc)})") from None


def _read_member(archive: tarfile.TarFile, member: tarfile.TarInfo, key: str, file: Path,
                 limit: int) -> bytes:
    where = f"member {member.name!r} at offset {member.offset}"
    if member.size > limit:
        raise _refuse(key, file, f"{where} holds {member.size:,} bytes, more than "
                      f"data.tar_member_max_bytes ({limit:,})",
                      hint="raise data.tar_member_max_bytes if the sample is meant to be that big")
    handle = archive.extractfile(member)
    if handle is None:  # pragma: no cover - regular files always have data
        raise _refuse(key, file, f"{where} has no data")
    try:
        data = handle.read(member.size)
    except READ_ERRORS as exc:
        raise _refuse(key, file, f"{where} is cut short or damaged ({_why(exc)})") from None
    if len(data) != member.size:
        raise _refuse(key, file, f"{where} is cut short ({len(data)} of {member.size} bytes)")
    return data


def _parse(data: bytes, name: str, key: str, file: Path) -> Any:
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        raise _refuse(key, file, f"member {name!r}: the key {exc.name!r} appears twice",
                      hint="give each key once per sample", refused=False) from None
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise _refuse(key, file, f"member {name!r} line {line}: not valid UTF-8 ({exc.reason})",
                      hint="save the samples as UTF-8", refused=False) from None
    except json.JSONDecodeError as exc:
        raise _refuse(key, file, f"member {name!r}: not valid JSON ({exc.msg} at line "
                      f"{exc.lineno} column {exc.colno})", refused=False) from None
    except RecursionError:
        raise _refuse(key, file, f"member {name!r}: JSON nested too deeply",
                      refused=False) from None


def _check_safe(member: tarfile.TarInfo, key: str, file: Path) -> None:
    name, parts = member.name, PurePosixPath(member.name).parts
    if name.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
        raise _refuse(key, file, f"member {name!r} has an absolute path or a '..' component",
                      hint="pack samples as plain .json files under relative paths")
    if member.issym() or member.islnk() or member.isdev() or member.isfifo():
        raise _refuse(key, file, f"member {name!r} is a link or a device, not a regular file",
                      hint="pack samples as plain .json files under relative paths")
    if member.issparse():
        raise _refuse(key, file, f"member {name!r} is a sparse file",
                      hint="pack samples as plain .json files")


def _check_end(block: bytes, offset: int, last: str, key: str, file: Path) -> None:
    """The block that ended the iteration must be the end-of-archive marker (zeros)."""
    if len(block) == BLOCK and not block.strip(b"\0"):
        return
    if not block:
        why = f"ends at offset {offset}{_after(last)} without the end-of-archive marker"
    elif len(block) < BLOCK:
        why = f"is cut short inside the header at offset {offset}{_after(last)}"
    else:
        why = f"has a damaged header at offset {offset}{_after(last)}"
    raise _refuse(key, file, why + "; it may be truncated or corrupted")


def _after(name: str) -> str:
    return f" (after member {name!r})" if name else " (before the first member)"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _refuse(key: str, file: Path, why: str, hint: str = "", refused: bool = True) -> RecipeError:
    tail = "; the archive is refused" if refused else ""
    return RecipeError([Problem(key, f"{file} {why}{tail}", hint=hint)])
