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


def check_shared_folder(comm: Collective, ctx: RankContext, folder: Path) -> None:
    """Every rank sees the files rank 0 writes in ``folder`` (the checkpoints of sharded ranks:
    each writes its optimizer shard there for rank 0 to move into the checkpoint). Ranks on
    nodes that do not share the folder are named before anything trains."""
    import os
    import secrets

    probe = ""
    if ctx.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        probe = f".ranks-share-{secrets.token_hex(8)}"
        (folder / probe).write_text(str(os.getpid()))
    probe = comm.gather(probe)[0]  # written before any rank looks
    sees = comm.gather((folder / probe).is_file())
    if ctx.is_main:
        (folder / probe).unlink(missing_ok=True)
    blind = [rank for rank, seen in enumerate(sees) if not seen]
    if blind:
        ranks = ", ".join(map(str, blind))
        raise RunnerError(f"rank(s) {ranks} cannot see the files rank 0 writes in {folder}: with "
                          "train.sharding = 'fsdp' every rank writes its optimizer shard into the "
                          "checkpoint folder; put run.output_dir on storage every node mounts")
