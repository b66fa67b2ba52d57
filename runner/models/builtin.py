"""Built-in models: one explicit table of names to builders, each built once into the cache.

A build writes into a temporary folder beside its final place and renames it when complete, so
a killed or concurrent build never leaves a half folder where loading looks. Builders of the
same model in several processes (ranks of one run, two runs) take a file lock and wait for each
other: the model is built once. Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

from runner.models.home import model_dir


@attrs.frozen
class TinySpec:
    """Shape and warm-up of one tiny arithmetic model (see ``runner.models.tiny``)."""

    tokenizer: str  # "bpe" | "char" (runner.models.tokenizer_build.SPECS)
    hidden_size: int
    num_layers: int
    steps: int  # supervised warm-up steps
    lr: float  # peak warm-up learning rate (linear warm-up, then linear decay to 0)
    batch_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    seed: int = 0
    warmup_hi: int = 20  # warm-up problems: the train split of operands 0..warmup_hi
    slip: float = 0.0  # share of warm-up answers written one too high (runner.models.tiny)


# Measured on a busy 2-core CPU (one build thread): held-out greedy / sampled (T=1) accuracy on
# 200 problems, and build time (about 2/3 of it on an idle machine).
TINY_SPECS: dict[str, TinySpec] = {
    # 0.335 / 0.28, 86 s. GRPO (recipes/grpo-arith.toml) lifted held-out accuracy from 0.28 to
    # 0.55-0.62 within 20-60 steps; the same model without slip (0.31) did not move in 300 steps
    "tiny-arith": TinySpec(
        tokenizer="bpe", hidden_size=128, num_layers=3, steps=800, lr=3e-3, slip=0.65
    ),
    # 0.36 / 0.295, 153 s: one token per character, so answers are spelled digit by digit
    "tiny-arith-char": TinySpec(
        tokenizer="char", hidden_size=128, num_layers=3, steps=1500, lr=3e-3
    ),
    # 0.885 / 0.64, 134 s: the same tokenizer (same ids) as tiny-arith, bigger, no slip
    "tiny-arith-teacher": TinySpec(
        tokenizer="bpe", hidden_size=160, num_layers=4, steps=900, lr=3e-3
    ),
}

Builder = Callable[[Path], dict[str, object]]


def _tiny(name: str) -> Builder:
    def build(folder: Path) -> dict[str, object]:
        from runner.models.tiny import build_tiny

        return build_tiny(folder, name, TINY_SPECS[name])

    return build


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
    "tiny-qwen3-vl": _tiny_vl,
    "smollm2-135m-instruct": _smollm2,
}

# config.json's model_type of each built-in, known without building it (checked by a test).
BUILTIN_MODEL_TYPES: dict[str, str] = {
    "tiny-arith": "qwen2",
    "tiny-arith-char": "qwen2",
    "tiny-arith-teacher": "qwen2",
    "tiny-qwen3-vl": "qwen3_vl",
    "smollm2-135m-instruct": "llama",
}


def is_built(folder: Path) -> bool:
    """A finished build: ``build_info.json`` is written last, just before the rename."""
    return (folder / "config.json").is_file() and (folder / "build_info.json").is_file()


@contextmanager
def _build_lock(final: Path) -> Iterator[None]:
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_built(name: str, builders: dict[str, Builder] = BUILTINS) -> Path:
    """The cached folder of built-in ``name``, building it first when absent.

    ``name`` must be a key of ``builders`` (``resolve_model_path`` checks it for users).
    """
    final = model_dir(name)
    if is_built(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final):
        if is_built(final):  # another process built it while this one waited
            return final
        for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any folder
        try:
            started = time.perf_counter()
            info = builders[name](tmp)
            info = {**info, "build_seconds": round(time.perf_counter() - started, 1)}
            text = json.dumps(info, indent=2, sort_keys=True) + "\n"
            (tmp / "build_info.json").write_text(text, encoding="utf-8")
            if final.exists():  # an unfinished folder from older code: replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
