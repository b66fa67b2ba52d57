"""What a checkpoint is on disk: its folders' and files' names, the training state it records
besides the weights (``TrainingState``), the RNG states and the optimizer's state as files.
``runner.state.checkpoint`` writes checkpoints, ``runner.state.load`` reads them.

Layout of ``<output_dir>/checkpoints/``::

    step-000020/            one complete checkpoint
      model/                the policy as a Hugging Face folder (safetensors) + tokenizer files
      extra_models/NAME/    other trained modules (e.g. the PPO critic), safetensors
      optimizer.safetensors optimizer tensors;   optimizer.json  its param groups and layout
      optimizer-rank-RRRRR-of-WWWWW.safetensors   instead, under train.sharding = "fsdp": each
                            rank's optimizer shards; optimizer.json then also lists the files,
                            the parameters' names and global shapes (runner.train.roles.sharding)
      optimizer-NAME.*      optimizers of the extra modules; under fsdp a sharded extra module
                            (PPO's critic) is gathered into extra_models/NAME/ like the policy,
                            and its optimizer written per rank as
                            optimizer-NAME-rank-RRRRR-of-WWWWW.safetensors + optimizer-NAME.json
      rng.safetensors       every rank's torch (and CUDA) RNG state, ``torch.R`` / ``cuda.R``
      state.json            step, cursor, scheduler, world size and global batch, every rank's
                            python/numpy RNG state, the tracker run ids (W&B, MLflow)
      metrics.jsonl         the metrics rows written up to this step
      MANIFEST.json         size and sha256 of every file above (runner.state.integrity)
      COMPLETE              written last, inside the temporary folder, before the rename
    latest                  name of the newest complete checkpoint (replaced atomically)

Loading never unpickles: tensors come from safetensors, everything else from JSON.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from runner.state import integrity

COMPLETE = "COMPLETE"
MODEL_DIR = "model"  # a checkpoint's model folder: a Hugging Face folder (or LoRA adapters)
EXTRA_DIR = "extra_models"  # the other trained modules' folders, one per module
SHARD_FILE = "optimizer-rank-{rank:05d}-of-{world:05d}.safetensors"  # train.sharding = "fsdp"
LATEST = "latest"
TMP_PREFIX = ".tmp-"


def shard_file(prefix: str, rank: int, world: int) -> str:
    """The name of rank ``rank``'s optimizer shard of the optimizer saved as ``prefix``
    (``optimizer``: the policy's, ``SHARD_FILE``; ``optimizer-NAME``: an extra module's)."""
    return f"{prefix}-rank-{rank:05d}-of-{world:05d}.safetensors"


def optimizer_prefix(name: str | None = None) -> str:
    """The name its files start with of the policy's optimizer (``name`` None) or of the extra
    module ``name``'s."""
    return "optimizer" if name is None else f"optimizer-{name}"


def step_dirname(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_step(folder: Path) -> int:
    """The step of a checkpoint folder named by ``step_dirname``."""
    return int(folder.name.split("-")[1])


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    return [p for p in integrity.step_folders(root) if (p / COMPLETE).is_file()]


@attrs.frozen
class TrainingState:
    """Everything besides module weights that a resumed run needs, as JSON-able values."""

    step: int
    cursor: dict[str, Any] | None
    scheduler: dict[str, Any]
    extra: dict[str, Any] = attrs.field(factory=dict)
    world_size: int = 1  # ranks that wrote it
    items_per_step: int | None = None  # the global batch (prompts or pairs) it was trained with
    trackers: dict[str, str] = attrs.field(factory=dict)  # tracker -> the run id a resume continues
    # per rank, the batches sampled ahead and not yet trained (algo.max_off_policy_steps >= 1)
    in_flight: list[Any] = attrs.field(factory=list)
    # the algo.max_off_policy_steps they were sampled with (None: written before it was kept)
    off_policy_steps: int | None = None


# --- RNG ----------------------------------------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """This process's RNG states as plain data (it travels between ranks before a save)."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    cuda = (torch.cuda.get_rng_state().numpy().tobytes()
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "torch": torch.get_rng_state().numpy().tobytes(), "cuda": cuda}


def restore_rng(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Set this process's RNG states to ``state`` (Python, numpy) and ``tensors`` (torch,
    CUDA), one rank's part of a checkpoint."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


# --- optimizer ----------------------------------------------------------------------------------

def optimizer_to_files(
    optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A whole optimizer's state as its JSON part (param groups, the slots' layout) and its
    tensors, by ``INDEX.SLOT``."""
    sd = optimizer.state_dict()
    tensors, layout = {}, {}
    for index, slots in sd["state"].items():
        layout[str(index)] = {}
        for name, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
                layout[str(index)][name] = "tensor"
            else:
                layout[str(index)][name] = value
    return {"param_groups": sd["param_groups"], "state": layout}, tensors


def optimizer_from_files(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The optimizer state dict that ``optimizer_to_files`` wrote as ``meta`` and ``tensors``."""
    state = {}
    for index, slots in meta["state"].items():
        state[int(index)] = {name: tensors[f"{index}.{name}"] if value == "tensor" else value
                             for name, value in slots.items()}
    # JSON has no tuples: give back the tuples (e.g. AdamW's betas) the optimizer wrote.
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}
