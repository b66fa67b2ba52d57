"""Which numeric precision a run computes in, decided once from the recipe and the hardware.

``train.precision = "auto"`` trains under bf16 autocast (fp32 master weights and optimizer state)
where bf16 matrix products are fast: a CUDA device that supports bf16, or a CPU with AVX-512 BF16
or AMX instructions. Elsewhere bf16 would be emulated and slower than fp32, so "auto" stays fp32.
``rollout.dtype = "auto"`` follows the policy's compute dtype under the same rule. Nothing here
imports torch at module level: the dry run and the validator call it too.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import attrs

from runner.recipe.schema import Recipe

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags this CPU reports (empty when unknown)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[-1].split())
    return frozenset()


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The bf16 matrix instruction sets this CPU reports (empty when none, or unknown)."""
    flags = cpu_flags(cpuinfo)
    return tuple(f for f in _CPU_BF16_FLAGS if f in flags)


@attrs.frozen
class Precision:
    """The resolved choice: what the trained models and the engine compute in, and why."""

    train: str  # "no" | "bf16" | "fp16": what Accelerate's mixed precision is given
    engine_dtype: str  # torch dtype name of the rollout engine's weights
    why: str

    @property
    def train_label(self) -> str:
        return {"no": "fp32",
                "bf16": "bf16 autocast, fp32 master weights"}.get(self.train, self.train)


def bf16_is_fast(device_type: str) -> tuple[bool, str]:
    """(whether bf16 matrix products are native on this device, the reason in words)."""
    if device_type == "cuda":
        import torch

        if torch.cuda.is_bf16_supported():
            return True, f"{torch.cuda.get_device_name()} supports bf16"
        return False, f"{torch.cuda.get_device_name()} lacks bf16"
    flags = cpu_bf16_flags()
    if flags:
        return True, f"this CPU has {' and '.join(flags)}"
    return False, "this CPU has neither AVX-512 BF16 nor AMX (bf16 would be emulated)"


def device_type(recipe: Recipe) -> str:
    if recipe.run.device != "auto":
        return recipe.run.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(recipe: Recipe, device: str | None = None) -> Precision:
    """The run's precision on ``device`` ("cpu" / "cuda"; default: where the run would train)."""
    dev = device or device_type(recipe)
    fast, reason = bf16_is_fast(dev)
    asked = recipe.train.precision
    if asked == "auto":
        train = "bf16" if fast and recipe.model.dtype == "float32" else "no"
        why = (f"train.precision auto: bf16 ({reason})" if train == "bf16" else
               f"train.precision auto: fp32 ({reason})" if recipe.model.dtype == "float32" else
               f"train.precision auto: none (model.dtype {recipe.model.dtype})")
    else:
        train, why = asked, f"train.precision {asked}"
    compute = {"bf16": "bfloat16", "fp16": "float16"}.get(train, recipe.model.dtype)
    engine = recipe.rollout.dtype
    if engine == "auto":
        if compute == "bfloat16" and not fast:
            engine, ewhy = "float32", f"rollout.dtype auto: float32 ({reason})"
        elif compute == "float64":
            engine, ewhy = "float64", "rollout.dtype auto: float64, as the policy"
        else:
            engine, ewhy = compute, f"rollout.dtype auto: {compute}, the policy's compute dtype"
    else:
        ewhy = f"rollout.dtype {engine}"
    return Precision(train, engine, f"{why}; {ewhy}")


def shares_policy(recipe: Recipe, p: Precision) -> bool:
    """Whether a local hf engine generates with the policy's own module instead of a copy
    (``rollout.share_policy``): only where a copy would hold the same numbers and nothing needs
    it to differ: the policy trains without autocast in the engine's dtype, is neither sharded
    nor LoRA (an engine reads merged weights), and no rollout overlaps training (a producer
    sampling ahead reads the last synced weights while the policy changes). A Ray rollout actor
    (``launch.placement = "separate"``) holds its own."""
    from runner.recipe.algos import spec_of

    r = recipe
    separate = r.launch.backend == "ray" and r.launch.placement == "separate"
    return (r.rollout.share_policy and r.rollout.engine == "hf" and not separate
            and r.train.sharding == "none"
            and r.model.lora.rank == 0 and not spec_of(r).ahead(r.algo) and p.train == "no"
            and p.engine_dtype == r.model.dtype)


def training_attention(device_type: str, bf16: bool) -> Any:
    """The attention kernels of a forward that will be differentiated, as a context manager.

    On CPU under bf16 autocast that is SDPA's plain (math) kernel: torch's fused CPU
    flash-attention backward is slow in bf16 (SmolLM2-135M, 24 x 40 tokens: 4.0 s forward and
    backward with it, 2.1 s with the math kernel; the same either way in fp32 and for no-grad
    forwards, benchmarks/README.md). Anywhere else, and for forwards without gradients, the
    default choice of kernels is left alone."""
    import contextlib

    import torch

    if device_type == "cpu" and bf16 and torch.is_grad_enabled():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()
