"""The setup handshake: after every rank has built its objects, the ranks compare what they
built and stop together, with one error naming the rank and the role, when any rank failed or
holds different data or model files (a built-in model built differently on another node is
exactly this case)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from runner.errors import RunnerError
from runner.ranks.collective import Collective
from runner.ranks.context import RankContext

_CHUNK = 1 << 20


def model_files_hash(folders: dict[str, Path]) -> dict[str, str]:
    """sha256 of each role's weight files (safetensors, in name order)."""
    out = {}
    for role, folder in folders.items():
        h = hashlib.sha256()
        for path in sorted(Path(folder).glob("*.safetensors")):
            h.update(path.name.encode())
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
        out[role] = h.hexdigest()
    return out


def handshake(comm: Collective, ctx: RankContext, failed: tuple[str, BaseException] | None,
              data_fingerprint: str, hashes: dict[str, str] | None) -> None:
    """Exchange (failure, data fingerprint, model hashes); raise on every rank if anything is
    off. A rank that failed re-raises its own error; the others name it."""
    mine = {"failed": None if failed is None else [failed[0], f"{type(failed[1]).__name__}: "
                                                   f"{failed[1]}"],
            "data": data_fingerprint, "models": hashes or {}}
    everyone = comm.gather(mine)
    if failed is not None:
        raise failed[1]
    for rank, theirs in enumerate(everyone):
        if theirs["failed"]:
            role, message = theirs["failed"]
            raise RunnerError(f"rank {rank} failed to build its {role}: {message}")
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs["data"] != first["data"]:
            raise RunnerError(f"rank {rank} built other training data than rank 0 (data "
                              f"fingerprint {theirs['data'][:12]} vs {first['data'][:12]})")
        for role, digest in first["models"].items():
            if theirs["models"].get(role) != digest:
                raise RunnerError(f"rank {rank}'s {role} model files differ from rank 0's "
                                  f"(sha256 {str(theirs['models'].get(role))[:12]} vs "
                                  f"{digest[:12]}): every rank must load the same weights")

