"""PPO's critic: a value head on a transformer backbone (a copy of the policy's, or a separate
model named by ``algo.critic_path``), built and prepared by the assembly like the policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runner.packers.base import PolicyBatch
from runner.recipe.schema import PPOConfig, Recipe
from runner.state.load import LoadedCheckpoint
from runner.train.roles import Trainable, prepare_trainable
from runner.train.roles.model_setup import trained_model

CRITIC = "critic"  # its name in checkpoints


class ValueModel(torch.nn.Module):
    """A transformer backbone with a scalar value head: values_BT for every position."""

    def __init__(self, backbone: Any, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        dtype = torch.promote_types(next(backbone.parameters()).dtype, torch.float32)
        self.v_head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.v_head.weight)
        torch.nn.init.zeros_(self.v_head.bias)

    @property
    def _no_split_modules(self) -> list[str]:
        """The backbone's transformer block classes: each one FSDP unit under
        ``train.sharding = "fsdp"`` (runner.train.roles.sharding.blocks_of), as in the policy."""
        return list(getattr(self.backbone, "_no_split_modules", None) or ())

    def forward(self, batch: PolicyBatch) -> torch.Tensor:
        """Values on the shifted grid [B, T-1]: the value of the state before token t+1."""
        from runner.train.roles.packing import attention_mask_kind

        hidden = self.backbone(input_ids=batch.input_ids_BT, use_cache=False,
                               **batch.model_kwargs(attention_mask_kind(self.backbone))
                               ).last_hidden_state
        values = self.v_head(hidden[:, :-1].to(self.v_head.weight.dtype)).squeeze(-1)
        # A sharded critic (FSDP2) returns no view: FSDP2 warns that an in-place op on one
        # would skip its pre-backward hook. The values are the same bits.
        return values.clone() if _sharded(self) else values


def _sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def critic_backbone(lm: Any) -> Any:
    """The module under the LM head whose hidden states the value head reads: the decoder of a
    text model; for a vision-language model its whole base model (vision tower included: the
    critic sees the images), which ``get_decoder`` would leave out."""
    base = getattr(lm, "model", None)
    if base is not None and getattr(base, "visual", None) is not None:
        return base
    return lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model


def build_critic(recipe: Recipe, model_path: Path, accelerator: Any,
                 ckpt: LoadedCheckpoint | None, *, sharded: bool = False, rank: int = 0,
                 world: int = 1) -> Trainable:
    """The critic, its optimizer and schedule, restored from ``ckpt`` when resuming. When the
    plan shards it (``sharded``: ``"critic" in plan.sharded``) it is sharded as the policy is
    (its optimizer built after sharding; a sharded checkpoint's optimizer shards read by
    ``rank`` of ``world``)."""
    from runner.models import load_causal_lm, resolve_model_path, text_hidden_size

    algo = recipe.algo
    assert isinstance(algo, PPOConfig)
    path = resolve_model_path(algo.critic_path, key="algo.critic_path") if algo.critic_path \
        else model_path
    lm = load_causal_lm(path, dtype=recipe.model.dtype,
                        trust_remote_code=recipe.model.trust_remote_code)
    backbone = critic_backbone(lm)  # the value head reads its forward, not the LM's
    trained_model(lm, recipe.train, called=backbone)
    critic = ValueModel(backbone, text_hidden_size(lm.config))
    if ckpt is not None:
        critic.load_state_dict(ckpt.extra_state(CRITIC))
    saved = ckpt.state.extra.get(CRITIC, {}) if ckpt else {}
    return prepare_trainable(accelerator, critic, recipe, lr=algo.critic_lr or None,
                             ckpt_optimizer=ckpt.extra_optimizer_state(CRITIC) if ckpt else None,
                             ckpt_scheduler=saved.get("scheduler"),
                             sharded=sharded, rank=rank, world=world)
