"""How much memory a run's model state takes per rank, estimated before anything is loaded.

The parameter count and shapes come from the model folders' safetensors headers (no weights
are read). Per rank, a trained model (the policy, PPO's critic) holds its parameters, a gradient
per trained parameter and AdamW's two moments per trained parameter, all in ``model.dtype``
(under bf16 autocast the master weights and the optimizer state stay in that dtype too); a
frozen model (the reference, OPD's teacher) holds its parameters, in bf16 under bf16 autocast.
Each rank of a DDP layout holds all of it; a sharded layout (FSDP) holds 1/world of each.
Activations, the rollout engine and the KV cache come on top and are not estimated.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import attrs

BYTES_OF = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_MAX_HEADER = 100 * 2**20


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the folder's ``*.safetensors`` files, from their headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise ValueError(f"{path}: a safetensors header of {size} bytes")
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(int(n) for n in info["shape"])
    return shapes


def count(shapes: dict[str, tuple[int, ...]]) -> int:
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def lora_count(shapes: dict[str, tuple[int, ...]], rank: int, targets: list[str]) -> int:
    """Adapter parameters: r x (in + out) per adapted linear layer (``targets``: suffixes of
    the layers' names; empty: every 2-D weight but the embeddings and the LM head)."""
    total = 0
    for name, shape in shapes.items():
        if len(shape) != 2 or not name.endswith(".weight"):
            continue
        layer = name.removesuffix(".weight")
        if targets:
            if not any(layer.endswith(t) for t in targets):
                continue
        elif "embed" in layer or layer.endswith("lm_head"):
            continue
        total += rank * (shape[0] + shape[1])
    return total


@attrs.frozen
class StateBytes:
    """Bytes per rank of one model's parameters, gradients and optimizer state."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def sharded(self, world: int) -> StateBytes:
        return StateBytes(-(-self.params // world), -(-self.grads // world),
                          -(-self.optimizer // world))


def trained_bytes(n_params: int, n_trained: int, dtype_bytes: int) -> StateBytes:
    """A trained model: its parameters, a gradient per trained one, AdamW's two moments."""
    return StateBytes(n_params * dtype_bytes, n_trained * dtype_bytes,
                      2 * n_trained * dtype_bytes)


def frozen_bytes(n_params: int, dtype_bytes: int) -> StateBytes:
    return StateBytes(n_params * dtype_bytes, 0, 0)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
