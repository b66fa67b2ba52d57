"""Assembling a run, shared by every algorithm: output folder, resume, data, models, engine.

The order matters and follows DESIGN §6: the saved data cursor is checked against the data
*before* any model is constructed, so a resume that cannot be exact fails in seconds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from runner.data.cursor import DataCursor, check_resume
from runner.recipe.plan import RunPlan
from runner.recipe.resolved import write_resolved
from runner.recipe.schema import Recipe
from runner.state.checkpoint import (
    LoadedCheckpoint,
    TrainingState,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from runner.train.policy import make_optimizer, make_scheduler, scheduler_state
from runner.ui import MetricsLog, Reporter


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A seed for (run seed, step, purpose): the same whether or not the run was resumed."""
    return (seed * 1_000_003 + step * 9_176 + salt) % 2**31


def find_resume(recipe: Recipe, plan: RunPlan) -> LoadedCheckpoint | None:
    if recipe.checkpoint.resume == "never":
        return None
    path = latest_checkpoint(plan.checkpoint_dir)
    return load_checkpoint(path) if path is not None else None


def resume_cursor(recipe: Recipe, ckpt: LoadedCheckpoint | None, parts_now: dict[str, str]
                  ) -> DataCursor | None:
    """The cursor to continue from, under ``data.cursor_resume`` (raises ResumeError)."""
    saved = saved_parts = None
    if ckpt is not None and ckpt.state.cursor is not None:
        saved = DataCursor.from_json(json.dumps(ckpt.state.cursor["cursor"]))
        saved_parts = ckpt.state.cursor.get("parts")
    if ckpt is None and recipe.data.cursor_resume == "strict":
        return None  # a fresh run: nothing to resume, strict has nothing to object to
    return check_resume(saved, parts_now, saved_parts, recipe.data.cursor_resume,
                        seed=recipe.run.seed)


def make_accelerator(recipe: Recipe) -> Any:
    from accelerate import Accelerator

    cpu = recipe.run.device == "cpu" or (recipe.run.device == "auto" and not torch.cuda.is_available())
    return Accelerator(cpu=cpu, mixed_precision=recipe.train.precision)


@attrs.define
class Trainable:
    """A trained module with its optimizer and schedule, prepared by Accelerate."""

    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR


def prepare_trainable(accelerator: Any, model: Any, recipe: Recipe, lr: float | None = None,
                      ckpt_optimizer: dict[str, Any] | None = None,
                      ckpt_scheduler: dict[str, Any] | None = None) -> Trainable:
    model.train()
    optimizer = make_optimizer(model, recipe.train, lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    if ckpt_optimizer is not None:
        optimizer.load_state_dict(ckpt_optimizer)
    scheduler = make_scheduler(optimizer, recipe.train, recipe.run.max_steps)
    if ckpt_scheduler is not None:
        scheduler.load_state_dict({**scheduler.state_dict(), **ckpt_scheduler})
    return Trainable(model, optimizer, scheduler)


def start_output(recipe: Recipe, plan: RunPlan, source: str, overrides: Sequence[str]) -> None:
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(recipe, plan.resolved_path, overrides, source)


def metrics_log(recipe: Recipe, plan: RunPlan, ckpt: LoadedCheckpoint | None) -> MetricsLog:
    tb = plan.output_dir / "tensorboard" if recipe.logging.tensorboard else None
    return MetricsLog(plan.metrics_path, ckpt.metrics_rows if ckpt else [], tb)


def restore_state(ckpt: LoadedCheckpoint) -> int:
    """Restore RNG states; returns the step the checkpoint was taken after."""
    restore_rng(ckpt.rng, ckpt.rng_tensors)
    return ckpt.state.step


def write_checkpoint(recipe: Recipe, plan: RunPlan, step: int, accelerator: Any, main: Trainable,
                     tokenizer: Any, cursor: DataCursor | None, parts: dict[str, str] | None,
                     metrics: MetricsLog, extra_modules: dict[str, torch.nn.Module] | None = None,
                     extra_optimizers: dict[str, Trainable] | None = None) -> Path:
    state = TrainingState(
        step=step,
        cursor=None if cursor is None else {"cursor": json.loads(cursor.to_json()), "parts": parts},
        scheduler=scheduler_state(main.scheduler),
        extra={name: {"scheduler": scheduler_state(t.scheduler)}
               for name, t in (extra_optimizers or {}).items()},
    )
    return save_checkpoint(
        plan.checkpoint_dir, step, model=accelerator.unwrap_model(main.model), tokenizer=tokenizer,
        optimizer=main.optimizer, state=state, metrics_rows=metrics.rows,
        extra_modules=extra_modules, keep_last=recipe.checkpoint.keep_last,
        extra_optimizers={name: t.optimizer for name, t in (extra_optimizers or {}).items()})


def announce(reporter: Reporter, recipe: Recipe, start_step: int, ckpt: LoadedCheckpoint | None) -> None:
    if ckpt is not None:
        reporter.message(f"resuming {recipe.run.name!r} from {ckpt.path} (step {start_step})")


@attrs.define
class PromptRun:
    """The live objects of a GRPO / PPO / OPD run, built in the order DESIGN §6 asks for."""

    recipe: Recipe
    plan: RunPlan
    reporter: Reporter
    accelerator: Any
    start_step: int
    ckpt: LoadedCheckpoint | None
    stream: Any  # runner.data.cursor.PromptStream
    parts: dict[str, str]
    val_items: list[Any]
    model_path: Path
    tokenizer: Any
    policy: Trainable
    rollout_packer: Any
    policy_packer: Any
    engine: Any
    metrics: MetricsLog

    def save(self, step: int, extra_modules: dict[str, torch.nn.Module] | None = None,
             extra_optimizers: dict[str, Trainable] | None = None) -> Path:
        return write_checkpoint(self.recipe, self.plan, step, self.accelerator, self.policy,
                                self.tokenizer, self.stream.cursor, self.parts, self.metrics,
                                extra_modules, extra_optimizers)

    def build_packer(self) -> Any:
        """A fresh packer from the student's factory (each role builds its own)."""
        from runner.packers import build_packer

        model_type = self.recipe.model.model_type or _model_type(self.model_path)
        return build_packer(self.model_path, model_type, self.recipe.data_packer.factory)

    def sample(self, n_prompts: int, n_samples: int, step: int) -> Any:
        """The next ``n_prompts`` items from the cursor, ``n_samples`` completions each, seeded
        from (run seed, step): the rollout every GRPO / PPO / OPD step starts with."""
        from runner.train.rollouts import roll_out, sampling

        items = self.stream.next_batch(n_prompts)
        params = sampling(self.recipe.rollout, n_samples, step_seed(self.recipe.run.seed, step))
        return roll_out(self.engine, self.rollout_packer, items, params)

    def sync_weights(self) -> None:
        model = self.accelerator.unwrap_model(self.policy.model)
        self.engine.update_weights((n, p.detach()) for n, p in model.named_parameters())


def _model_type(path: Path) -> str:
    from runner.models import read_model_type

    return read_model_type(path)


def open_prompt_run(recipe: Recipe, plan: RunPlan, reporter: Reporter, source: str,
                    overrides: Sequence[str]) -> PromptRun:
    from runner.data.cursor import PromptStream
    from runner.data.membership import check_overlap
    from runner.data.sources import build_prompt_sources, check_columns
    from runner.models import load_causal_lm, load_tokenizer, read_model_type, resolve_model_path
    from runner.packers import build_packer
    from runner.rollout.factory import make_engine

    seed_everything(recipe.run.seed, recipe.run.deterministic)
    train_source, val_source = build_prompt_sources(recipe.data, recipe.algo.kind)
    check_columns(train_source)
    if val_source is not None:
        check_columns(val_source)
        check_overlap(train_source, val_source)
    ckpt = find_resume(recipe, plan)
    parts = train_source.fingerprint_parts()
    cursor = resume_cursor(recipe, ckpt, parts)  # before any model is built
    start_output(recipe, plan, source, overrides)
    start_step = restore_state(ckpt) if ckpt else 0
    announce(reporter, recipe, start_step, ckpt)
    base_path = resolve_model_path(recipe.model.path)
    model_path = ckpt.model_dir if ckpt else base_path
    model_type = recipe.model.model_type or read_model_type(base_path)
    # The tokenizer and packers come from the base folder: training changes weights only.
    tokenizer = load_tokenizer(base_path, trust_remote_code=recipe.model.trust_remote_code)
    accelerator = make_accelerator(recipe)
    model = load_causal_lm(model_path, dtype=recipe.model.dtype,
                           trust_remote_code=recipe.model.trust_remote_code)
    policy = prepare_trainable(accelerator, model, recipe,
                               ckpt_optimizer=ckpt.optimizer_state if ckpt else None,
                               ckpt_scheduler=ckpt.state.scheduler if ckpt else None)
    factory = recipe.data_packer.factory
    rollout_packer = build_packer(base_path, model_type, factory)
    policy_packer = build_packer(base_path, model_type, factory)
    engine = make_engine(recipe, model_path)
    stream = PromptStream(train_source, recipe.run.seed, recipe.data.shuffle, cursor=cursor)
    val_items = ([val_source.item(i) for i in range(len(val_source))]
                 if val_source is not None else [])
    return PromptRun(recipe, plan, reporter, accelerator, start_step, ckpt, stream, parts,
                     val_items, base_path, tokenizer, policy, rollout_packer, policy_packer,
                     engine, metrics_log(recipe, plan, ckpt))
