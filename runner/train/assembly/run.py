"""One rank's run as the loops see it: its roles, its data and resume state, and the run
object itself (``RunContext``), with its checkpoint write. ``runner.train.assembly.assemble``
builds it whole before the loop starts; nothing assigns to it afterwards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from runner.data.cursor import PromptData
from runner.data.preference import PreferenceData
from runner.packers.base import DataPacker
from runner.rewards import RewardSet
from runner.state.checkpoint import ModuleState, ShardedState, WholeState, save_checkpoint
from runner.state.layout import TrainingState, capture_rng, optimizer_prefix
from runner.state.load import LoadedCheckpoint
from runner.train.assembly.services import RunServices
from runner.train.loops.pipeline import Producer
from runner.train.roles import Frozen, FrozenScorer, RoleProvider, Rollout, Trainable
from runner.train.roles.policy import scheduler_state
from runner.train.roles.teacher import Teacher
from runner.types import ObsBundle


@attrs.define
class Roles:
    """The models and functions a loop uses besides the policy and the rollout, built by the
    assembly exactly as the plan lists them (``RunPlan.roles``); None where it lists none."""

    reference: FrozenScorer | None = None
    critic: Trainable | None = None
    teacher: Teacher | None = None
    rewards: RewardSet | None = None


@attrs.frozen(eq=False)
class RunState:
    """Where this rank's run starts and what it reads: the step and checkpoint it resumes from
    and its data."""

    start_step: int
    ckpt: LoadedCheckpoint | None
    data: PromptData | PreferenceData  # the algorithm's stream (assembly.streams.open_data)
    parts: dict[str, str]  # the data's fingerprint parts (saved with the cursor)
    val_items: list[ObsBundle]  # this rank's shard of the held-out prompts
    has_held_out: bool  # a held-out set exists (each rank evaluates its shard of it)


@attrs.frozen(eq=False)
class RunContext:
    """One rank's run, built whole by ``assemble`` before the loop starts and never changed
    after: its services (``svc``), its data and resume state (``state``), the policy with its
    rollout, the other roles (``roles``) and, when the plan samples ahead (``plan.ahead``),
    the producer of those batches."""

    svc: RunServices
    state: RunState
    model_path: Path  # the base model folder (tokenizer and packers come from it)
    tokenizer: Any  # the base model's tokenizer, or its processor (a vision-language model)
    policy: Trainable
    policy_packer: DataPacker
    rollout: Rollout | None
    roles: Roles = attrs.field(factory=Roles)
    actors: RoleProvider | None = None  # roles served outside this rank (Ray role actors)
    producer: Producer | None = None  # the batches sampled ahead (plan.ahead >= 1), if any

    def frozen(self, role: str, path: Path, pad_free: bool = False) -> FrozenScorer:
        """The frozen model of ``role`` ("reference" or "teacher") loaded from ``path``, scoring
        padding-free batches when ``pad_free``: in this process, or the role's actor when it has
        one."""
        if self.actors is not None and self.actors.frozen_of(role) is not None:
            return self.actors.remote_frozen(role, self.svc.accelerator.device, pad_free)
        recipe = self.svc.recipe
        sharded = role in self.svc.plan.sharded
        return Frozen(path, recipe, self.svc.accelerator.device, pad_free,
                      bf16=self.svc.precision.train == "bf16", sharded=sharded)

    @property
    def rollout_packer(self) -> DataPacker:
        return self.rollout.packer if self.rollout else self.policy_packer

    def build_packer(self) -> DataPacker:
        """A fresh packer from the student's factory (each role builds its own)."""
        from runner.models import read_model_type
        from runner.packers import build_packer

        m = self.svc.recipe.model
        model_type = m.model_type or read_model_type(self.model_path)
        return build_packer(self.model_path, model_type, self.svc.recipe.data_packer.factory,
                            trust_remote_code=m.trust_remote_code, dtype=m.dtype)

    def sync_weights(self) -> None:
        """The rollout gets the policy's weights. An engine every rank shares (a rollout actor)
        gets them from rank 0 once, after every rank's producer has finished its batch (with
        ``algo.max_off_policy_steps >= 1``), and no rank goes on before it has them."""
        if self.rollout is None:
            return
        if not self.rollout.shared:
            self.rollout.update_weights(self.policy.named_weights())
            return
        if self.producer is not None:  # no rank's producer may still be sampling from it
            self.svc.comm.barrier()
        if self.svc.rank.is_main:
            self.rollout.update_weights(self.policy.named_weights())
        elif self.policy.sharded:  # the gathers are collectives: every rank takes part
            for _ in self.policy.named_weights():
                pass
        self.svc.comm.barrier()

    def save(self, step: int, extra: dict[str, Trainable] | None = None) -> Path | None:
        """Checkpoint ``step`` with the policy and the modules of ``extra`` (PPO's critic):
        every rank's RNG state goes to rank 0, which writes; the ranks leave together once the
        checkpoint is complete."""
        rngs = self.svc.comm.gather(capture_rng())
        flights = self.svc.comm.gather(self.producer.to_json()) if self.producer else []
        extra = extra or {}
        # every rank in the same (the caller's) order: a sharded module's gathers are collectives
        policy = self._module_state(step, self.policy, optimizer_prefix())
        modules = {name: self._module_state(step, t, optimizer_prefix(name))
                   for name, t in extra.items()}
        path = None
        if self.svc.rank.is_main:
            path = write_checkpoint(self, step, rngs, policy, modules, extra, flights)
        self.svc.comm.barrier()
        return path

    def _module_state(self, step: int, trainable: Trainable, prefix: str) -> ModuleState:
        """A module's part of a checkpoint (the policy's, or an extra module's such as PPO's
        critic). Whole: the module and its optimizer. Sharded, made by every rank: the whole
        weights (gathered one tensor at a time, kept by rank 0) and each rank's shard of the
        optimizer saved as ``prefix``, staged beside the checkpoints for rank 0 to move in."""
        if not trainable.sharded:
            return WholeState(trainable.unwrapped(), trainable.optimizer)
        from runner.train.roles.lora import is_adapter, is_lora
        from runner.train.roles.sharding import (
            full_state_dict,
            optimizer_shard,
            stage_optimizer_shard,
        )

        is_main = self.svc.rank.is_main
        weights = full_state_dict(trainable.model, keep=is_main,  # LoRA: the adapters alone
                                  only=is_adapter if is_lora(trainable.model) else None)
        index, tensors = optimizer_shard(trainable.optimizer, trainable.model)
        staged = stage_optimizer_shard(self.svc.plan.checkpoint_dir, step, self.svc.rank.rank,
                                       tensors, prefix)
        del tensors
        paths = tuple(Path(p) for p in self.svc.comm.gather(str(staged)))
        return ShardedState(trainable.unwrapped(), weights, index, paths)

    def close(self, outcome: str = "finished") -> None:
        """``outcome`` (finished, stopped or failed) is what the trackers record."""
        self.svc.metrics.close(outcome)
        if self.rollout is not None:
            self.rollout.close()
        if self.svc.lock is not None:
            self.svc.lock.release()


def write_checkpoint(run: RunContext, step: int, rngs: list[dict[str, Any]],
                     policy: ModuleState, modules: dict[str, ModuleState],
                     extra: dict[str, Trainable], in_flight: list[Any] | None = None) -> Path:
    """Rank 0's write of checkpoint ``step``: ``policy`` and ``modules``, the parts of the
    policy and of the trainables of ``extra`` (whose schedulers the training state records),
    every rank's RNG states ``rngs`` and its batches ``in_flight``."""
    cursor, plan = run.state.data.cursor, run.svc.plan
    state = TrainingState(
        step=step,
        cursor={"cursor": json.loads(cursor.to_json()), "parts": run.state.parts},
        scheduler=scheduler_state(run.policy.scheduler),
        extra={name: {"scheduler": scheduler_state(t.scheduler)} for name, t in extra.items()},
        world_size=plan.world_size, items_per_step=plan.items_per_step,
        trackers=run.svc.metrics.tracker_ids(), in_flight=list(in_flight or []),
        off_policy_steps=plan.ahead,
    )
    return save_checkpoint(
        plan.checkpoint_dir, step, policy=policy, tokenizer=run.tokenizer, state=state,
        metrics_rows=run.svc.metrics.rows, extra=modules,
        keep_last=run.svc.recipe.checkpoint.keep_last, rng_per_rank=rngs)
