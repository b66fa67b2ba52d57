"""``train.sharding = "fsdp"``: the trained models (the policy, PPO's critic) sharded with
torch's FSDP2 (``fully_shard``).

Each transformer block (a module whose class the model lists in ``_no_split_modules``, else each
entry of ``model.model.layers``) is one FSDP unit, the root (embeddings, final norm, LM head)
another. Parameters, gradients and the optimizer state are ``DTensor`` shards on dim 0.

``fully_shard`` is called directly, not through Accelerate's FSDP plugin: the plugin wraps
through its own ``prepare`` with CUDA assumptions in places, while the direct call runs the same
on CPU/gloo and on CUDA/NCCL and leaves the wrapping units, the mixed-precision policy and the
gradient-sync switch of accumulation in this module's hands.

LoRA (``model.lora.rank > 0``) wraps the base model before sharding: base weights and adapters
are sharded alike, the optimizer holds the adapters alone, a checkpoint gathers the adapters
alone (peft's adapter folder) and the rollout engine gets each adapted layer merged.

What leaves a rank (weights to the rollout engine, the checkpoint's model folder) is gathered
one parameter at a time (``DTensor.full_tensor()``: a collective every rank takes part in), so
no rank holds two full copies. The optimizer state is checkpointed per rank, without pickle:
``optimizer-rank-RRRRR-of-WWWWW.safetensors`` (each rank's local shards) and ``optimizer.json``
(param groups, slot layout, parameter names and global shapes, the files); PPO's critic the same
way under ``optimizer-critic``. The critic's weights are gathered into the checkpoint's
``extra_models/critic/`` as a whole critic's are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from runner.ranks.collective import local_process_group

SHARDED = "shard0"  # layout of a slot saved as each rank's dim-0 shard (a DTensor)
REPLICATED = "tensor"  # a slot every rank holds whole (AdamW's step)


def blocks_of(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks of ``model``: modules whose class name the model lists in
    ``_no_split_modules``, else the entries of ``model.model.layers``. Deeper ones first (a
    block inside another, as in some vision towers, must be sharded before its parent)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [(name.count("."), m) for name, m in model.named_modules()
             if type(m).__name__ in names and m is not model]
    if found:
        return [m for _, m in sorted(found, key=lambda d: -d[0])]  # stable: siblings in order
    layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def shard_model(model: Any, bf16: bool, device: torch.device | str = "cpu",
                weights: Path | None = None) -> Any:
    """``model`` moved to ``device`` and sharded in place over every rank of the default process
    group, block by block and then the root (fp32 master weights; with ``bf16`` the forward and
    backward compute in bf16 and gradients are reduced in fp32). The mesh is named explicitly:
    FSDP2's default one would take the accelerator even for a run on the CPU.

    An empty model (``load_for_sharding``: parameters on the meta device) is sharded empty and
    each rank then fills its own shards from the safetensors files of ``weights``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = torch.device(device)
    local_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    empty = weights is not None
    if not empty:
        model.to(device)
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError(f"train.sharding = 'fsdp': found no transformer blocks in "
                         f"{type(model).__name__} (no _no_split_modules, no model.layers)")
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if bf16 else MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if empty:
        fill_shards(model, weights, device)
    return model


def load_for_sharding(path: Path, dtype: str, trust_remote_code: bool) -> tuple[Any, Path | None]:
    """(the model of ``path`` for ``shard_model``, the folder its shards are filled from).

    Empty (nothing loaded; ``shard_model(..., weights=folder)`` then reads each rank's shards)
    when the folder's safetensors files name every parameter as the model does; otherwise the
    whole model, loaded as without sharding (folder None), e.g. for a model family whose
    checkpoint keys transformers renames on load."""
    from runner.models.loading import empty_causal_lm, load_causal_lm
    from runner.models.memory import tensor_shapes

    model = empty_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code)
    stored = tensor_shapes(path)
    if all(tuple(p.shape) == stored.get(name) for name, p in model.named_parameters()):
        return model, path
    return load_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code), None


def fill_shards(model: Any, folder: Path, device: torch.device) -> None:
    """Materialise an empty sharded ``model`` on ``device``: each parameter's shard on this rank
    read from ``folder``'s safetensors files, one whole tensor at a time from the
    memory-mapped file, cast to the parameter's dtype as ``from_pretrained`` casts it; the
    buffers (computed when the model was built) kept, and a persistent one the files hold
    read from them. No rank ever holds the whole model."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = list(model.named_buffers())
    model.to_empty(device=device)
    files = [safe_open(path, "pt") for path in sorted(Path(folder).glob("*.safetensors"))]
    where = {name: f for f in files for name in f.keys()}
    persistent = model.state_dict(keep_vars=True).keys()
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = where[name].get_tensor(name).to(p.dtype)
            if isinstance(p, DTensor):
                local = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(local.to_local())
            else:
                p.copy_(whole)
            del whole
        for name, b in buffers:
            owner, _, leaf = name.rpartition(".")
            stored = name in persistent and name in where
            value = where[name].get_tensor(name).to(b.dtype) if stored else b
            model.get_submodule(owner)._buffers[leaf] = value.to(device)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank must call it), or ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def scalar(t: Any) -> float:
    """A Python float of a (possibly DTensor) scalar."""
    return float(full(t)) if isinstance(t, torch.Tensor) else float(t)


def resharded(model: Any) -> Any:
    """``model`` with every FSDP unit's parameters back to their fp32 shards: a forward without
    backward leaves the root's unsharded (in the compute dtype) until the next backward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def full_named_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of every parameter, gathered one at a time as the consumer asks
    (every rank must consume the whole generator, in step). A LoRA model's are the base
    model's names with its adapters merged in (runner.train.roles.lora.merged_weights)."""
    from runner.train.roles.lora import is_lora, merged_weights

    if is_lora(model):
        yield from merged_weights(resharded(model), fetch=full)
        return
    for name, p in resharded(model).named_parameters():
        yield name, full(p.detach())


def full_state_dict(model: Any, keep: bool, only: Callable[[str], bool] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The model's state dict (the entries whose names ``only`` accepts) as full CPU tensors,
    gathered one at a time (every rank takes part; only where ``keep`` are they kept). A tied
    tensor is kept under its first name only (the embeddings, not the LM head that shares
    them), as ``save_pretrained`` writes it."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in resharded(model).state_dict(keep_vars=True).items():  # tied: the same Parameter
        if id(t) in seen or (only is not None and not only(name)):
            continue
        seen.add(id(t))
        whole = full(t.detach())
        if keep:
            out[name] = whole.cpu()
        del whole
    return out


# --- the optimizer state, per rank ---------------------------------------------------------------

def optimizer_shard(optimizer: torch.optim.Optimizer, model: Any
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the index: param groups, slot layout, names and global shapes; this rank's tensors)."""
    from torch.distributed.tensor import DTensor

    sd = optimizer.state_dict()
    names = _param_names(optimizer, model)
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, dict[str, Any]] = {}
    for index, slots in sd["state"].items():
        layout[str(index)] = {}
        for slot, value in slots.items():
            if isinstance(value, DTensor):
                tensors[f"{index}.{slot}"] = value.to_local().detach().cpu().clone()
                layout[str(index)][slot] = SHARDED
            elif isinstance(value, torch.Tensor):
                tensors[f"{index}.{slot}"] = value.detach().cpu().clone()
                layout[str(index)][slot] = REPLICATED
            else:
                layout[str(index)][slot] = value
    params = {str(i): {"name": n, "shape": list(p.shape)} for i, (n, p) in enumerate(names)}
    return {"param_groups": sd["param_groups"], "state": layout, "params": params}, tensors


def _param_names(optimizer: torch.optim.Optimizer, model: Any
                 ) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's parameters in its state-dict order, with their names in ``model``."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [(by_id.get(id(p), ""), p) for g in optimizer.param_groups for p in g["params"]]


def stage_optimizer_shard(root: Path, step: int, rank: int, tensors: dict[str, torch.Tensor],
                          prefix: str = "optimizer") -> Path:
    """Write this rank's shard of the optimizer saved as ``prefix`` (the policy's
    ``optimizer``, an extra module's ``optimizer-NAME``) beside the checkpoints under a
    temporary name ending in this process's id (``save_checkpoint`` moves it into the
    checkpoint; a writer that died leaves it to the next save's cleanup)."""
    import os

    from safetensors.torch import save_file

    from runner.state.layout import TMP_PREFIX, step_dirname

    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{TMP_PREFIX}{prefix}-{step_dirname(step)}-rank{rank}-{os.getpid()}"
    save_file(tensors, out)
    return out


def load_optimizer_shards(optimizer: torch.optim.Optimizer, folder: Path, index: dict[str, Any],
                          rank: int, world: int) -> None:
    """Load a sharded optimizer checkpoint into ``optimizer`` (of a sharded or a whole model).

    The same world size and a sharded model read this rank's file alone; otherwise each slot is
    put together from every rank's file (one slot at a time) and cut to this rank's share.
    Nothing is unpickled: tensors come from safetensors, the rest from JSON.
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    files = index["files"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(params) != len(index["params"]):
        raise ValueError(f"the checkpoint's optimizer has {len(index['params'])} parameters, "
                         f"this model {len(params)}")
    own = len(files) == world and all(isinstance(p, DTensor) for p in params)
    handles = [safe_open(folder / f, "pt") for f in (files[rank:rank + 1] if own else files)]
    state: dict[int, dict[str, Any]] = {}
    for key, slots in index["state"].items():
        p = params[int(key)]
        state[int(key)] = {}
        for slot, kind in slots.items():
            name = f"{key}.{slot}"
            if kind == REPLICATED:
                value = handles[0].get_tensor(name)
            elif kind == SHARDED:
                if own:
                    value = DTensor.from_local(handles[0].get_tensor(name), p.device_mesh,
                                               p.placements, shape=p.shape, stride=p.stride())
                else:
                    whole = torch.cat([h.get_tensor(name) for h in handles])
                    value = (distribute_tensor(whole, p.device_mesh, p.placements,
                                               src_data_rank=None)
                             if isinstance(p, DTensor) else whole)
            else:
                value = kind
            state[int(key)][slot] = value
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in index["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def distribute_full_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]
                          ) -> dict[str, Any]:
    """A whole-model optimizer state dict (``train.sharding = "none"``'s checkpoint) cut to this
    rank's shards of ``optimizer``'s sharded parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index, slots in sd["state"].items():
        p = params[int(index)]
        state[index] = {
            slot: (distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
                   if isinstance(p, DTensor) and isinstance(v, torch.Tensor)
                   and tuple(v.shape) == tuple(p.shape) else v)
            for slot, v in slots.items()}
    return {**sd, "state": state}
