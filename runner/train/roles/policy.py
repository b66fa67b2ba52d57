"""The policy side, shared by every algorithm: forward passes to token logprobs, the optimizer and
LR schedule."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from runner.algorithms.logprobs import token_logprobs
from runner.algorithms.masked import at_least_float32
from runner.packers.base import PolicyBatch, RLPolicyInput
from runner.recipe.schema import Recipe, TrainConfig
from runner.state.layout import MODEL_DIR


def forward_logits(model: Any, batch: PolicyBatch, keep_from: int = 0, upcast: bool = True
                   ) -> torch.Tensor:
    """Logits predicting token t+1 from tokens <= t, for the shifted-grid columns
    ``keep_from .. T-2``: shape [B, T-1-keep_from, V], float32 (float64 when the model computes
    in float64; the model's own dtype with ``upcast=False``). With ``keep_from > 0`` the LM head
    runs only on those positions (the model's ``logits_to_keep``) when the model supports it."""
    # No KV cache: none is needed to score, and transformers only detects packed sequences (and
    # builds the block-diagonal mask from the restarting position ids) when there is none.
    from runner.train.roles.packing import attention_mask_kind

    kwargs: dict[str, Any] = {"use_cache": False,
                              **batch.model_kwargs(attention_mask_kind(model))}
    T = batch.input_ids_BT.shape[1]
    keep = keep_from > 0 and _takes_logits_to_keep(model)
    if keep:
        kwargs["logits_to_keep"] = T - keep_from
    logits = model(input_ids=batch.input_ids_BT, **kwargs).logits
    logits = logits[:, :-1] if keep else logits[:, keep_from:-1]
    return at_least_float32(logits) if upcast else logits


def _takes_logits_to_keep(model: Any) -> bool:
    return _forward_takes_logits_to_keep(type(getattr(model, "module", model)))  # DDP: its module


@functools.cache
def _forward_takes_logits_to_keep(cls: type) -> bool:
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def first_loss_column(batch: PolicyBatch) -> int:
    """The first shifted-grid column any row takes the loss on (0 for none): columns before it
    hold prompt tokens only."""
    cols = batch.loss_mask_BT[:, 1:].any(0).nonzero()
    return int(cols[0]) if len(cols) else 0


def batch_logprobs(model: Any, batch: PolicyBatch, temperature: float = 1.0,
                   pad_free: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_BT, mask_BT) of each token given its prefix, on the shifted grid [B, T-1].

    ``mask_BT`` marks completion tokens that the loss is taken on. Logits are divided by the
    sampling temperature so the values match the engine's sampling distribution. Only the
    columns from the first completion token on are scored (the LM head never runs on prompt
    positions); columns before it are 0. With ``pad_free`` a padded batch of several rows runs
    packed (``runner.train.roles.packing``), with the same values on the same grid.
    """
    if pad_free and not batch.packed and batch.input_ids_BT.shape[0] > 1:
        from runner.train.roles.packing import packed_logprobs

        packed = packed_logprobs(model, batch, temperature,
                                 takes_logits_to_keep=_takes_logits_to_keep(model))
        if packed is not None:
            return packed
    start = first_loss_column(batch)
    logits = forward_logits(model, batch, start, upcast=False)  # bf16 stays bf16 (chunked)
    lp = token_logprobs(logits, batch.input_ids_BT[:, 1 + start:], temperature)
    lp_BT = torch.zeros(lp.shape[0], batch.input_ids_BT.shape[1] - 1, dtype=lp.dtype,
                        device=lp.device)
    lp_BT[:, start:] = lp
    return lp_BT, batch.loss_mask_BT[:, 1:].bool()


def completion_grid(inputs: Sequence[RLPolicyInput], values: Sequence[Sequence[float]],
                    width: int) -> torch.Tensor:
    """Place per-completion-token values on the shifted grid [B, width] (0 elsewhere).

    Completion token j of sequence b sits at input position n_prompt + j, i.e. grid column
    n_prompt + j - 1 (its logit is produced by the previous token).
    """
    rows = []  # one tensor from lists (a write per row costs more on short rows)
    for x, vals in zip(inputs, values, strict=True):
        n = min(len(vals), len(x.input_ids) - x.n_prompt_tokens)
        start = x.n_prompt_tokens - 1
        row = [0.0] * width
        row[start:start + n] = vals[:n]
        if len(row) != width:
            raise ValueError(f"completion values at columns {start}..{start + n} do not fit a "
                             f"grid {width} wide")
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).reshape(len(inputs), width)


def make_optimizer(model: Any, cfg: TrainConfig, lr: float | None = None,
                   head_lr: float | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: torch's fused kernel where the parameters live on a
    device it has one for (CPU, CUDA; one pass over each tensor instead of a dozen), else the
    multi-tensor ``foreach`` form. Both compute the same update (to the last bit or so); the
    fused step of SmolLM2-135M's fp32 state takes a fifth of the time on two CPU cores
    (benchmarks/README.md).

    With ``head_lr`` (a score model's ``algo.head_lr``) the parameters outside the model's base
    model (transformers' ``base_model``: the score head) train at ``head_lr``, the others at
    ``lr``: one parameter group per run of consecutive parameters of one kind, so the
    optimizer's parameters keep the model's order (``runner.state.fit.shapes_of``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                                 for p in params)
    base_lr = lr or cfg.lr
    groups: Any = params
    if head_lr:
        head = head_parameter_names(model)
        groups = [{"params": [p for _, p in run], "lr": head_lr if is_head else base_lr}
                  for is_head, run in itertools.groupby(named, key=lambda np: np[0] in head)]
    return torch.optim.AdamW(groups, lr=base_lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             weight_decay=cfg.weight_decay,
                             **({"fused": True} if fused else {"foreach": True}))


def head_parameter_names(model: Any) -> frozenset[str]:
    """The names (as ``model.named_parameters`` gives them) of the parameters outside
    transformers' ``model.base_model``: a ``*ForSequenceClassification``'s score head."""
    base = getattr(model, "base_model", model)
    if base is model:
        raise ValueError(f"{type(model).__name__} has no base model to tell its head from")
    inside = {id(p) for p in base.parameters()}
    return frozenset(n for n, p in model.named_parameters() if id(p) not in inside)


def lr_factor(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak LR after ``step`` scheduler steps: linear warm-up, then the shape."""

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        if cfg.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
                   ) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, total_steps))


def scheduler_state(scheduler: torch.optim.lr_scheduler.LambdaLR) -> dict[str, Any]:
    """The JSON-able part of a LambdaLR's state (the lambdas are rebuilt from the recipe)."""
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}



def checkpoint_policy(recipe: Recipe, ckpt: Path) -> Any:
    """The policy a checkpoint folder of a run of ``recipe`` holds, as one model: its weights
    (full fine-tuning; a reward model's with its score head, ``AlgoSpec.head``), or its LoRA
    adapters merged into the base model's weights (W + (alpha / r) B A)."""
    from runner.models import load_causal_lm, resolve_model_path
    from runner.recipe.algos import spec_of

    m = recipe.model
    if m.lora.rank == 0:
        return load_causal_lm(ckpt / MODEL_DIR, dtype=m.dtype,
                              trust_remote_code=m.trust_remote_code, head=spec_of(recipe).head)
    from runner.train.roles.lora import apply_lora, load_adapters

    base = load_causal_lm(resolve_model_path(m.path), dtype=m.dtype,
                          trust_remote_code=m.trust_remote_code)
    model = apply_lora(base, m.lora, recipe.run.seed)
    load_adapters(model, ckpt / MODEL_DIR)
    return model.merge_and_unload()
