"""LoRA adapters on the policy (Hu et al. 2021, arXiv:2106.09685) through ``peft``.

Only the adapters train: the optimizer holds them alone and checkpoints save them alone (peft's
adapter folder: ``adapter_config.json`` + ``adapter_model.safetensors``). The base weights come
from the base model folder on every start, so a resumed run loads base + saved adapters. The
rollout engine never sees adapters: it receives each adapted layer's merged weight
W + (alpha / r) B A under the base model's own parameter names, in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from runner.recipe.schema import LoraConfig

ADAPTER = "default"
_PREFIX = "base_model.model."


def enabled(cfg: LoraConfig) -> bool:
    return cfg.rank > 0


def apply_lora(model: Any, cfg: LoraConfig, seed: int) -> Any:
    """``model`` wrapped with fresh adapters (B = 0, so the adapted model equals the base).

    A's random initialisation is drawn from its own generator (seeded by the run seed), leaving
    the global RNG as it was: a resumed run, which then overwrites the adapters, draws the same
    numbers afterwards as the uninterrupted one."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                            target_modules=list(cfg.target_modules) or "all-linear", bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def load_adapters(model: Any, adapter_dir: Path) -> None:
    """Put the adapter weights saved in ``adapter_dir`` into the wrapped ``model``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(adapter_dir / "adapter_model.safetensors")
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"{adapter_dir} holds adapter weights this model has no place for: "
                         f"{unexpected[:3]} (was it trained with other [model.lora] keys?)")


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config")


def is_adapter(name: str) -> bool:
    """A parameter (or state-dict entry) of an adapter, by its name in the wrapped model."""
    return ".lora_" in name


def merged_weights(model: Any, fetch: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's parameters by their own names, adapted layers merged (no gradient).

    ``fetch`` turns a parameter into the whole tensor: on a sharded model (FSDP2) it gathers
    it (a collective: every rank must consume the generator in step), one base weight and its
    two adapters at a time."""
    from peft.tuners.lora import LoraLayer

    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        owner, _, leaf = name.rpartition(".")
        value = fetch(param.detach()) if fetch else param.detach()
        if owner.endswith(".base_layer") and leaf == "weight":
            layer = modules[owner[: -len(".base_layer")]]
            if isinstance(layer, LoraLayer) and ADAPTER in layer.lora_A:
                with torch.no_grad():
                    delta = (layer.get_delta_weight(ADAPTER) if fetch is None
                             else _gathered_delta(layer, fetch))
                    value = value + delta.to(value.dtype)
        yield _base_name(name), value


def _gathered_delta(layer: Any, fetch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A linear layer's (alpha / r) B A from its gathered adapters, as peft's
    ``get_delta_weight`` computes it (half precision multiplied in fp32)."""
    a_module, b_module = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]
    if not isinstance(a_module, torch.nn.Linear):
        raise ValueError(f"a sharded LoRA model merges linear adapters only, not "
                         f"{type(a_module).__name__} (model.lora.target_modules)")
    a, b = fetch(a_module.weight.detach()), fetch(b_module.weight.detach())
    half = a.dtype in (torch.float16, torch.bfloat16)
    delta = b.float() @ a.float() if half else b @ a
    if layer.fan_in_fan_out:
        delta = delta.T
    return (delta * layer.scaling[ADAPTER]).to(a.dtype)


def _base_name(name: str) -> str:
    name = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
    return name.replace(".base_layer.", ".")


def trainable_share(model: Any) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total
