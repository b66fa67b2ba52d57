"""Built-in models: one explicit table of names to builders.

The tiny models (``SHIPPED``) come with the package as ordinary model folders under
``runner/models/shipped/``: a run loads those files and builds nothing, so every machine trains
the same weights whatever its CPU (a build on another CPU's float kernels gives other weights).
``python -m runner.models.rebuild`` makes them again, on purpose, and records the CPU that did.
SmolLM2 is converted from its package's GGUF file into the cache on first use
(``runner.models.home``).

A build writes into a temporary folder beside its final place and renames it when complete, so
a killed or concurrent build never leaves a half folder where loading looks. Builders of the
same model in several processes (ranks of one run, two runs) take a file lock and wait for each
other: the model is built once. Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from runner.errors import Problem, RecipeError
from runner.models.home import model_dir
from runner.models.specs import TINY_SPECS

Builder = Callable[[Path], dict[str, object]]
SHIPPED_ROOT = Path(__file__).resolve().parent / "shipped"
INFO = "build_info.json"  # written last; lists every other file with its sha256


def _tiny(name: str) -> Builder:
    def build(folder: Path) -> dict[str, object]:
        from runner.models.tiny import build_tiny

        return build_tiny(folder, name, TINY_SPECS[name])

    return build


def _tiny_code(folder: Path) -> dict[str, object]:
    from runner.models.specs import CODE_SPECS
    from runner.models.tiny_code import build_tiny_code

    return build_tiny_code(folder, "tiny-code", CODE_SPECS["tiny-code"])


def _tiny_tools(folder: Path) -> dict[str, object]:
    from runner.models.tiny_tools import build_tiny_tools

    return build_tiny_tools(folder, "tiny-arith-tools")


def _tiny_vl(folder: Path) -> dict[str, object]:
    from runner.models.tiny_vl import build_tiny_vl

    return build_tiny_vl(folder, "tiny-qwen3-vl")


def _smollm2(folder: Path) -> dict[str, object]:
    from runner.models.smollm2 import convert

    return convert(folder)


BUILTINS: dict[str, Builder] = {
    "tiny-arith": _tiny("tiny-arith"),
    "tiny-arith-char": _tiny("tiny-arith-char"),
    "tiny-arith-teacher": _tiny("tiny-arith-teacher"),
    "tiny-arith-restate": _tiny("tiny-arith-restate"),
    "tiny-arith-tools": _tiny_tools,
    "tiny-code": _tiny_code,
    "tiny-qwen3-vl": _tiny_vl,
    "smollm2-135m-instruct": _smollm2,
}
SHIPPED = ("tiny-arith", "tiny-arith-char", "tiny-arith-teacher", "tiny-arith-restate",
           "tiny-arith-tools", "tiny-code", "tiny-qwen3-vl")

# config.json's model_type of each built-in, known without loading it (checked by a test).
BUILTIN_MODEL_TYPES: dict[str, str] = {
    "tiny-arith": "qwen2",
    "tiny-arith-char": "qwen2",
    "tiny-arith-teacher": "qwen2",
    "tiny-arith-restate": "qwen2",
    "tiny-arith-tools": "qwen2",
    "tiny-code": "qwen2",
    "tiny-qwen3-vl": "qwen3_vl",
    "smollm2-135m-instruct": "llama",
}


def is_built(folder: Path) -> bool:
    """A finished build: ``build_info.json`` is written last, just before the rename."""
    return (folder / "config.json").is_file() and (folder / INFO).is_file()


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file of a model folder but ``build_info.json``, by file name."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != INFO
    }


def shipped_folder(name: str, root: Path | None = None) -> Path:
    """The folder of shipped built-in ``name``; a missing or incomplete one is a RecipeError."""
    folder = (root or SHIPPED_ROOT) / name
    if not is_built(folder) or not (folder / "model.safetensors").is_file():
        hint = f"reinstall the package, or rebuild it: python -m runner.models.rebuild {name}"
        raise RecipeError([Problem("model.path", "the shipped folder of this built-in model is "
                                   "missing or incomplete", got=str(folder), hint=hint)])
    return folder


def builtin_folder(name: str) -> Path:
    """The folder of built-in ``name`` (a key of ``BUILTINS``): shipped, or built into the cache."""
    return shipped_folder(name) if name in SHIPPED else ensure_built(name)


@contextmanager
def _build_lock(final: Path) -> Iterator[None]:
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_into(final: Path, builder: Builder, *, replace: bool = False) -> Path:
    """Build into ``final`` (a temporary folder beside it, renamed when complete) unless a
    finished build is there and ``replace`` is false; ``build_info.json`` gets the build's time
    and every file's sha256."""
    if is_built(final) and not replace:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final):
        if is_built(final) and not replace:  # another process built it while this one waited
            return final
        for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any folder
        try:
            started = time.perf_counter()
            info = builder(tmp)
            for path in tmp.iterdir():  # some writers make their files private
                path.chmod(0o644)
            info = {**info, "build_seconds": round(time.perf_counter() - started, 1),
                    "files": file_hashes(tmp)}
            text = json.dumps(info, indent=2, sort_keys=True) + "\n"
            (tmp / INFO).write_text(text, encoding="utf-8")
            if final.exists():  # an older or unfinished folder: replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_built(name: str, builders: dict[str, Builder] = BUILTINS) -> Path:
    """The cached folder of built-in ``name``, building it first when absent."""
    return build_into(model_dir(name), builders[name])
