"""Built-in models: an explicit table of names to builders, built once into the cache.

A build writes into a temporary folder beside its final place and renames it when complete, so
a killed or concurrent build never leaves a half folder where loading looks.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from runner.models.home import model_dir
from runner.models.tiny import TinySpec

# The tiny arithmetic models: (tokenizer, hidden size, layers, warm-up steps, warm-up lr).
TINY_SPECS: dict[str, TinySpec] = {
    "tiny-arith": TinySpec(tokenizer="bpe", hidden_size=128, num_layers=3, steps=450, lr=3e-3),
    "tiny-arith-char": TinySpec(tokenizer="char", hidden_size=128, num_layers=3, steps=450, lr=3e-3),
    "tiny-arith-teacher": TinySpec(tokenizer="bpe", hidden_size=192, num_layers=4, steps=1500, lr=2e-3),
}


def _tiny(name: str) -> Callable[[Path], dict[str, object]]:
    def build(folder: Path) -> dict[str, object]:
        from runner.models.tiny import build_tiny

        return build_tiny(folder, name, TINY_SPECS[name])

    return build


def _smollm2(folder: Path) -> dict[str, object]:
    from runner.models.smollm2 import convert

    return convert(folder)


BUILTINS: dict[str, Callable[[Path], dict[str, object]]] = {
    "tiny-arith": _tiny("tiny-arith"),
    "tiny-arith-char": _tiny("tiny-arith-char"),
    "tiny-arith-teacher": _tiny("tiny-arith-teacher"),
    "smollm2-135m-instruct": _smollm2,
}


def ensure_built(name: str) -> Path:
    """The cached folder of built-in ``name``, building it first when absent."""
    final = model_dir(name)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        info = BUILTINS[name](tmp)
        if not (tmp / "build_info.json").exists():
            (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same build first: keep theirs
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
