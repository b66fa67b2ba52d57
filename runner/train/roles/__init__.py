"""The roles of a run behind small interfaces: the trained modules (policy, critic), the frozen
scorers (reference, teacher; in this process or in a role's actor), and the rollout (engine +
its packer).

Loops call these methods and never reach into a role's internals, so a role can live in another
process (``RoleProvider``: the launcher's role actors) without the loops changing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from runner.envs import EpisodePlayer
from runner.envs.episodes import EpisodeResult
from runner.errors import NonFiniteUpdate
from runner.models.compiled import compile_forwards
from runner.packers.base import DataPacker, PolicyBatch
from runner.recipe.schema import Recipe
from runner.rollout.base import RolloutEngine, RolloutOutput, SamplingConfig
from runner.rollout.lengths import PromptLimit
from runner.train.roles.policy import batch_logprobs, forward_logits, make_optimizer, make_scheduler
from runner.types import ObsBundle


@attrs.define
class Trainable:
    """A trained module with its optimizer and schedule, prepared by Accelerate (DDP across
    ranks when there are several), or sharded with FSDP2 (``sharded``,
    runner.train.roles.sharding)."""

    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    accelerator: Any
    pad_free: bool = False  # score padded batches packed (runner.train.roles.packing)
    sharded: bool = False  # train.sharding = "fsdp": parameters are DTensor shards

    @property
    def lockstep(self) -> bool:
        """Its forwards are collectives every rank joins: DDP broadcasts its buffers, FSDP2
        gathers its parameters (runner.train.loops.batches.lockstep)."""
        return True

    def logprobs(self, batch: PolicyBatch, temperature: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        with self._attention():
            return batch_logprobs(self.model, batch, temperature, self.pad_free)

    def logits(self, batch: PolicyBatch, keep_from: int = 0) -> torch.Tensor:
        """Next-token logits on the shifted grid's columns ``keep_from ..`` (a language model):
        [B, T-1-keep_from, V]; the LM head runs on those positions only
        (``forward_logits``)."""
        with self._attention():
            return forward_logits(self.model, batch, keep_from)

    def scores(self, batch: PolicyBatch) -> torch.Tensor:
        """A score model's scalar per row [B] (float32 or wider): its forward as transformers
        runs it, the score head's output at each row's last token that is not the pad token
        (``config.pad_token_id``), so a saved folder scores the same outside the runner."""
        from runner.rewards.model import sequence_scores

        with self._attention():
            return sequence_scores(self.model, batch)

    def __call__(self, batch: PolicyBatch) -> torch.Tensor:
        """The module's own output (a critic's values)."""
        with self._attention():
            return self.model(batch)

    def padding_metrics(self, batch: PolicyBatch) -> dict[str, float]:
        """The padded share of ``batch`` and of the layout this module's forwards compute it in."""
        from runner.train.roles.packing import attention_mask_kind, padding_metrics

        return padding_metrics(batch, self.pad_free, attention_mask_kind(self.model))

    def _attention(self) -> Any:
        from runner.precision import training_attention

        return training_attention(self.accelerator.device.type,
                                  self.accelerator.mixed_precision == "bf16")

    def unwrapped(self) -> Any:
        return self.model if self.sharded else self.accelerator.unwrap_model(self.model)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights a rollout engine loads: the model's own parameter names (LoRA adapters
        merged into the layers they adapt). Sharded: each gathered whole as the consumer asks
        for it, one at a time (every rank must consume all of them, in step)."""
        from runner.train.roles.lora import is_lora, merged_weights

        if self.sharded:
            from runner.train.roles.sharding import full_named_weights

            return full_named_weights(self.model)
        model = self.unwrapped()
        if is_lora(model):
            return merged_weights(model)
        return ((n, p.detach()) for n, p in model.named_parameters())


def prepare_trainable(accelerator: Any, model: Any, recipe: Recipe, lr: float | None = None,
                      ckpt_optimizer: dict[str, Any] | None = None,
                      ckpt_scheduler: dict[str, Any] | None = None,
                      pad_free: bool = False, sharded: bool = False,
                      rank: int = 0, world: int = 1, weights: Path | None = None,
                      head_lr: float | None = None) -> Trainable:
    """``sharded``: FSDP2 (runner.train.roles.sharding) instead of Accelerate's DDP; the
    optimizer is built after sharding, so its state is sharded too; ``weights``: the folder an
    empty model (``load_for_sharding``) fills its shards from. ``ckpt_optimizer`` is a
    checkpoint's whole optimizer state, or the index of a sharded one (``{"sharded": index,
    "folder": ...}``, this rank's shard read by ``rank`` of ``world``). ``head_lr``: a score
    model's head learning rate (``make_optimizer``).
    """
    model.train()
    if sharded:
        from runner.train.roles.sharding import shard_model

        model = shard_model(model, bf16=accelerator.mixed_precision == "bf16",
                            device=accelerator.device, weights=weights)
        optimizer = make_optimizer(model, recipe.train, lr, head_lr)
    else:
        optimizer = make_optimizer(model, recipe.train, lr, head_lr)
        model, optimizer = accelerator.prepare(model, optimizer)
    if ckpt_optimizer is not None:
        _load_optimizer(optimizer, ckpt_optimizer, sharded, rank, world)
    scheduler = make_scheduler(optimizer, recipe.train, recipe.run.max_steps)
    if ckpt_scheduler is not None:
        scheduler.load_state_dict({**scheduler.state_dict(), **ckpt_scheduler})
    return Trainable(model, optimizer, scheduler, accelerator, pad_free, sharded)


def _load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any], sharded: bool,
                    rank: int, world: int) -> None:
    from runner.train.roles import sharding

    if "sharded" in saved:  # written by sharded ranks: per-rank safetensors files
        sharding.load_optimizer_shards(getattr(optimizer, "optimizer", optimizer),
                                       saved["folder"], saved["sharded"], rank, world)
    elif sharded:
        optimizer.load_state_dict(sharding.distribute_full_state(optimizer, saved))
    else:
        optimizer.load_state_dict(saved)


def optimizer_step(trainables: Sequence[Trainable],
                   micro_losses: Sequence[Callable[[], torch.Tensor]],
                   max_grad_norm: float) -> float:
    """One optimizer step of every trainable from the summed micro-batch losses (each already
    weighted by its share of the batch): backward each, clip each module, step each. Returns
    the first module's gradient norm (NaN without clipping).

    Gradients are synchronised across ranks on the last micro-batch only.
    """
    for t in trainables:
        t.optimizer.zero_grad(set_to_none=True)
    acc = trainables[0].accelerator
    losses_finite = True
    for i, loss_fn in enumerate(micro_losses):
        loss = loss_fn()
        losses_finite = losses_finite and bool(torch.isfinite(loss.detach()).all())
        # The backward under the forwards' attention kernels (a layer that gradient
        # checkpointing recomputes in it must take the kernel its forward took), synchronising
        # gradients on the last micro-batch only.
        last = i == len(micro_losses) - 1
        with (trainables[0]._attention(),
              contextlib.nullcontext() if last else _no_sync_all(acc, trainables)):
            acc.backward(loss)
    norms = [_clip(acc, t, max_grad_norm) if max_grad_norm > 0 else _grad_norm(t)
             for t in trainables]
    # Gradients are averaged over ranks by now, so every rank sees the same norms and stops
    # together; the update (and any checkpoint of it) never happens.
    if not losses_finite or not all(math.isfinite(n) for n in norms):
        what = "the loss" if not losses_finite else "the gradient norm"
        value = next((n for n in norms if not math.isfinite(n)), float("nan"))
        raise NonFiniteUpdate(f"{what} is not finite (gradient norm {value:g}): the update was "
                              "not applied and nothing of this step is checkpointed; earlier "
                              "checkpoints are untouched")
    for t in trainables:
        t.optimizer.step()
    return norms[0] if max_grad_norm > 0 else float("nan")


def _clip(acc: Any, t: Trainable, max_grad_norm: float) -> float:
    """Clip ``t``'s gradients to ``max_grad_norm`` and return their total norm before clipping.
    Sharded gradients are DTensors: torch's clip reduces their norm over the ranks (the whole
    model's norm, the same on every rank)."""
    if t.sharded:
        from runner.train.roles.sharding import scalar

        return scalar(torch.nn.utils.clip_grad_norm_(t.model.parameters(), max_grad_norm))
    return float(acc.clip_grad_norm_(t.model.parameters(), max_grad_norm))


def _grad_norm(t: Trainable) -> float:
    """The total 2-norm of the gradients (computed only to check they are finite)."""
    grads = [p.grad for p in t.model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    if t.sharded:
        from runner.train.roles.sharding import scalar

        return scalar(torch.nn.utils.get_total_norm(grads))
    return float(torch.nn.utils.get_total_norm(grads))


class _sync_off:
    """FSDP2's counterpart of DDP's ``no_sync``: gradients accumulate unsharded and are
    reduce-scattered on the next backward that syncs (the last micro-batch's)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc: object) -> None:
        self.model.set_requires_gradient_sync(True)


def _no_sync(acc: Any, t: Trainable) -> Any:
    return _sync_off(t.model) if t.sharded else acc.no_sync(t.model)


class _no_sync_all:
    def __init__(self, acc: Any, trainables: Sequence[Trainable]) -> None:
        self.contexts = [_no_sync(acc, t) for t in trainables]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


class FrozenScorer(Protocol):
    """A frozen model that scores batches: ``Frozen`` here, or one in a role's actor."""

    sharded: bool  # its parameters are sharded over the ranks (FSDP2)

    @property
    def lockstep(self) -> bool:
        """Its forwards are collectives every rank joins (when it is sharded)."""
        ...

    def logprobs(self, batch: PolicyBatch, temperature: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token logprobs at ``temperature`` and their mask, on the shifted grid [B, T-1]."""
        ...

    def logits(self, batch: PolicyBatch, keep_from: int = 0) -> torch.Tensor:
        """Next-token logits on the shifted grid's columns ``keep_from ..``: [B, T-1-keep_from,
        V]."""
        ...


class RoleProvider(Protocol):
    """Roles that live outside this rank (the launcher's role actors): the assembly asks it
    first and builds in this process what it does not serve."""

    @property
    def rollout(self) -> Any:
        """Truthy when it serves the rollout engine."""
        ...

    def rollout_engine(self, ctx: Any) -> RolloutEngine: ...

    def frozen_of(self, role: str) -> Any:
        """The actor of ``role`` ("reference", "teacher"), or None."""
        ...

    def remote_frozen(self, role: str, device: Any, pad_free: bool = False) -> FrozenScorer: ...

    def remote_rewards(self) -> dict[str, Any]:
        """The reward functions it serves (reward models), by ``reward.functions[i]`` key."""
        ...


class Frozen:
    """A frozen model that scores batches in this process: the reference, or the teacher's."""

    def __init__(self, path: Path, recipe: Recipe, device: Any, pad_free: bool = False,
                 bf16: bool = False, sharded: bool = False) -> None:
        """``bf16``: score under bf16 autocast, as the trained models run (the run's precision,
        decided once by the assembly). ``sharded``: its parameters sharded over the ranks with
        FSDP2 (``train.sharding = "fsdp"``), gathered block by block in each forward, so every
        rank must score as many batches."""
        from runner.models import load_causal_lm

        self.path = path
        self.pad_free = pad_free
        m = recipe.model
        if sharded:  # each rank reads its own shards (or, failing that, loads the whole model)
            from runner.train.roles.sharding import load_for_sharding, shard_model

            self.model, weights = load_for_sharding(path, m.dtype, m.trust_remote_code)
            self.model.requires_grad_(False).eval()
            shard_model(self.model, bf16=False, device=device, weights=weights)
        else:
            self.model = load_causal_lm(path, dtype=m.dtype, trust_remote_code=m.trust_remote_code)
            self.model.requires_grad_(False).eval().to(device)
            if recipe.train.compile:
                compile_forwards(self.model)
        self.sharded = self.lockstep = sharded  # a sharded model's forwards are collectives
        self.device_type = torch.device(device).type
        self.bf16 = bf16

    @torch.no_grad()
    def logprobs(self, batch: PolicyBatch, temperature: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
            return batch_logprobs(self.model, batch, temperature, self.pad_free)

    @torch.no_grad()
    def logits(self, batch: PolicyBatch, keep_from: int = 0) -> torch.Tensor:
        """Next-token logits on the shifted grid's columns ``keep_from ..``: [B, T-1-keep_from,
        V] (OPD's full KL; outside autocast, as the teacher's logits have always been
        computed)."""
        return forward_logits(self.model, batch, keep_from)


class Rollout:
    """The rollout role: the engine and the rollout-side packer that feeds it."""

    def __init__(self, engine: RolloutEngine, packer: DataPacker,
                 limit: PromptLimit | None = None, env: EpisodePlayer | None = None) -> None:
        self.engine = engine
        self.packer = packer
        self.limit = limit or PromptLimit(None, "no limit")
        self.env = env  # plays multi-turn episodes ([env]); None: one reply per completion

    @property
    def shared(self) -> bool:
        """One engine serves every rank (a rollout actor): rank 0 alone updates its weights."""
        return self.engine.shared

    def generate(self, items: Sequence[ObsBundle], sampling: SamplingConfig,
                 seeds: Sequence[int] | None = None) -> list[RolloutOutput]:
        """The engine's outputs for ``items``. A prompt that does not fit the engine's
        ``max_model_len`` with ``sampling.max_new_tokens`` is refused naming its row: by its
        characters before it is rendered, by its tokens after."""
        prompts = []
        for item in items:
            self.limit.check_item(item, sampling.max_new_tokens)
            prompt = self.packer.engine_prompt(self.packer.get_rollout_input(item))
            self.limit.check_tokens(len(prompt.full_ids), sampling.max_new_tokens,
                                    item.origin.where, item.origin.prompt_column)
            prompts.append(prompt)
        return self.engine.generate(prompts, sampling, seeds)

    def play(self, items: Sequence[ObsBundle], sampling: SamplingConfig,
             seeds: Sequence[int] | None = None, step: int | None = None
             ) -> list[EpisodeResult]:
        """``sampling.n`` episodes of each of ``items``, played with this engine."""
        assert self.env is not None

        def check(tokens: int, max_new: int, item: ObsBundle) -> None:
            self.limit.check_tokens(tokens, max_new, item.origin.where, item.origin.prompt_column)

        return self.env.play(self.engine.generate, check, items, sampling, seeds, step,
                             self.limit.max_model_len)

    def update_weights(self, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
        self.engine.close()
