"""Assembling a run on one rank, shared by every algorithm: ``assemble(...) -> RunContext``.

The order follows DESIGN §6: the data is built and the saved cursor checked against it
*before* any model is constructed, so a resume that cannot be exact fails in seconds. Every
rank builds its own objects from the recipe (datasets, packers, models, engine); then the ranks
exchange what they built (success, data fingerprint, hashes of the model files) and stop
together, naming the rank and role, when anything failed or differs. Only rank 0 writes the
run folder (resolved recipe, metrics, checkpoints) and shows progress.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from runner.data.cursor import DataCursor, check_resume
from runner.envs.build import build_env_runner
from runner.errors import Problem, RecipeError, RunnerError, RuntimeFailure
from runner.packers.base import DataPacker
from runner.precision import Precision, device_type, resolve
from runner.ranks.collective import Collective
from runner.ranks.context import RankContext
from runner.recipe.algos import spec_of
from runner.recipe.checks import batch_key, trackers_of
from runner.recipe.held_out import held_out_reason
from runner.recipe.plan import RunPlan
from runner.recipe.resolved import resolved_document, write_resolved
from runner.recipe.schema import Recipe
from runner.rewards import build_rewards
from runner.rollout.lengths import PromptLimit
from runner.state.checkpoint import LoadedCheckpoint, load_latest, restore_rng
from runner.state.run_folder import RunLock
from runner.train.handshake import check_shared_folder, handshake, model_files_hash
from runner.train.pipeline import Producer, make_producer
from runner.train.roles import RoleProvider, Rollout, disable_dropout, prepare_trainable
from runner.train.rollouts import sample_ahead
from runner.train.run import Roles, RunContext, RunState
from runner.train.seeds import seed_everything
from runner.train.services import RunServices
from runner.train.streams import OpenedData, Streamed, open_data
from runner.train.teacher import Teacher
from runner.ui import MetricsLog, Reporter
from runner.ui.trackers import Trackers, TrackerSetup

if TYPE_CHECKING:
    from accelerate import Accelerator


def find_resume(recipe: Recipe, plan: RunPlan, reporter: Reporter) -> LoadedCheckpoint | None:
    """The newest intact checkpoint that loads and fits the recipe's model (damaged, unparsable
    or misfitting newer ones are skipped, saying why)."""
    from runner.state.fit import recipe_check

    if recipe.checkpoint.resume == "never":
        return None
    return load_latest(plan.checkpoint_dir, on_skip=reporter.message, fits=recipe_check(recipe))


def refuse_pickled(ckpt: LoadedCheckpoint) -> None:
    """A checkpoint's model loads from safetensors only: one whose weights were swapped for a
    pickle (``pytorch_model.bin``) is refused, never unpickled."""
    from runner.models.loading import pickled_weights

    found = pickled_weights(ckpt.model_dir) if ckpt.model_dir.is_dir() else []
    if found:
        raise RuntimeFailure("resume", None, f"cannot load checkpoint {ckpt.path}: model/ holds "
                             f"pickled weights ({', '.join(found[:3])}) and no model.safetensors; "
                             "weights are loaded from safetensors only (nothing is unpickled)")


def check_world_change(recipe: Recipe, plan: RunPlan, ckpt: LoadedCheckpoint) -> None:
    """Another world size continues exactly only over the same global batch."""
    saved_world, saved_items = ckpt.state.world_size, ckpt.state.items_per_step
    if saved_world == plan.world_size or saved_items == plan.items_per_step:
        return
    key, _ = batch_key(recipe)
    raise RecipeError([Problem(
        "launch.num_processes", f"the checkpoint {ckpt.path.name} was written by {saved_world} "
        f"rank(s) with {key} = {saved_items}; resuming on {plan.world_size} rank(s) with "
        f"{plan.items_per_step} would not continue the same data", got=plan.world_size,
        hint=f"keep {key} = {saved_items} (any launch.num_processes dividing it), or start a new "
        "run.output_dir")])


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


def make_accelerator(device: str, precision: Precision) -> Accelerator:
    from accelerate import Accelerator

    return Accelerator(cpu=device == "cpu", mixed_precision=precision.train)


def prompt_limit(recipe: Recipe, base: Path, packer: DataPacker, tokenizer: Any,
                  opened: OpenedData, streamed: Streamed, *, remote: bool) -> PromptLimit:
    """The engine's ``max_model_len`` and the check of every prompt that can be checked before
    the run (``runner.rollout.lengths.run_limit``). A Ray rollout actor sizes its engine
    without the prompts, so ranks that use one measure none."""
    from runner.rollout.lengths import run_limit

    sources, held_out = opened.prompts_to_check(streamed)
    return run_limit(recipe, base, packer, tokenizer, sources, held_out, measure=not remote)


class BuildSteps:
    """Runs the build in named roles, remembering the first that failed (and how)."""

    def __init__(self) -> None:
        self.failed: tuple[str, BaseException] | None = None

    def __call__(self, role: str, build: Callable[[], Any]) -> Any:
        if self.failed is not None:
            return None
        try:
            return build()
        except (RunnerError, RecipeError, OSError, ValueError, RuntimeError, ImportError) as exc:
            self.failed = (role, exc)
            return None


def assemble(recipe: Recipe, plan: RunPlan, *, ctx: RankContext, comm: Collective,
             reporter: Reporter, source: str, overrides: Sequence[str],
             actors: RoleProvider | None = None, stop: Callable[[], bool] | None = None
             ) -> RunContext:
    """Build every role the plan lists (``plan.roles``), in this process or, where ``actors``
    serves it, as a handle on the launcher's role actor."""
    from runner.models import load_causal_lm, load_codec, read_model_type, resolve_model_path
    from runner.packers import build_packer
    from runner.rollout.factory import make_engine

    device = device_type(recipe)
    precision = resolve(recipe, device)  # once per rank: the trained, frozen and engine dtypes

    seed_everything(recipe.run.seed, recipe.run.deterministic)
    step = BuildSteps()
    # The writer locks the run folder before reading its checkpoints: a second run on the same
    # folder stops here, before it reads or writes anything there.
    lock = step("output", lambda: RunLock.acquire(plan.output_dir)) if ctx.is_main else None
    ckpt = step("checkpoint", lambda: find_resume(recipe, plan, reporter))
    if ckpt is not None:
        step("checkpoint", lambda: check_world_change(recipe, plan, ckpt))
        step("checkpoint", lambda: refuse_pickled(ckpt))
    opened = step("data", lambda: open_data(recipe, ctx))
    parts = opened.fingerprint_parts() if opened else {}
    cursor = step("data", lambda: resume_cursor(recipe, ckpt, parts))  # before any model
    streamed = step("data", lambda: opened.stream(recipe, ctx, cursor))
    data = streamed.data if streamed else None
    if ctx.is_main and step.failed is None:
        step("output", lambda: (plan.output_dir.mkdir(parents=True, exist_ok=True),
                                write_resolved(recipe, plan.resolved_path, overrides, source)))
    start_step = 0
    if ckpt is not None and step.failed is None:
        restore_rng(ckpt.rng_of_rank(ctx.rank), ckpt.rng_tensors_of_rank(ctx.rank))
        start_step = ckpt.state.step
        reporter.message(f"resuming {recipe.run.name!r} from {ckpt.path} (step {start_step})")
    base = step("policy", lambda: resolve_model_path(recipe.model.path))
    trust, dtype = recipe.model.trust_remote_code, recipe.model.dtype
    model_type = step("policy", lambda: recipe.model.model_type or read_model_type(base))
    # The tokenizer and packers come from the base folder: training changes weights only.
    # Checkpoints save it beside the weights: a vision-language model's processor (its
    # tokenizer, image and video processor configs, chat template), so a checkpoint folder
    # loads with AutoProcessor too.
    tokenizer = step("policy", lambda: load_codec(base, trust))
    # With LoRA the base weights always come from the base folder; a checkpoint holds adapters.
    lora = recipe.model.lora.rank > 0
    model_dir = ckpt.model_dir if ckpt and not lora else base
    # Sharded (full fine-tuning): an empty model whose shards each rank reads after the
    # handshake (``weights``: their folder), so that no rank holds the whole model (LoRA wraps
    # a loaded one).
    def load() -> tuple[Any, Path | None]:
        if "policy" in plan.sharded and not lora:
            from runner.train.sharding import load_for_sharding

            return load_for_sharding(model_dir, dtype, trust)
        return load_causal_lm(model_dir, dtype=dtype, trust_remote_code=trust), None

    model, weights = step("policy", load) or (None, None)
    model = _trained(model, recipe) if model is not None else None
    if lora and model is not None:
        model = step("policy", lambda: _with_adapters(model, recipe, ckpt, reporter))
    factory = recipe.data_packer.factory
    options = {"trust_remote_code": trust, "dtype": dtype}
    packer = step("policy", lambda: build_packer(base, model_type, factory, **options))
    generates = "rollout" in plan.roles
    engine_packer = (step("rollout", lambda: build_packer(base, model_type, factory, **options))
                     if generates else None)
    # Every rank checks every prompt it can before the run (and measures them for a derived
    # vllm max_model_len), before the handshake: a refused prompt stops every rank at once.
    remote = bool(actors is not None and actors.rollout)
    limit = (step("rollout", lambda: prompt_limit(recipe, base, engine_packer, tokenizer,
                                                   opened, streamed, remote=remote))
             if generates else None)
    fingerprint = data.cursor.fingerprint if data is not None else ""
    hashes = (step("policy", lambda: model_files_hash(_model_folders(recipe, plan.roles, base)))
              if ctx.world_size > 1 else {})
    # Before the first collective of the build (DDP's parameter broadcast, the engine's setup):
    # a rank that failed must not leave the others waiting inside one.
    handshake(comm, ctx, step.failed, fingerprint, hashes)
    if plan.sharded and ctx.world_size > 1:
        check_shared_folder(comm, ctx, plan.checkpoint_dir)
    accelerator = make_accelerator(device, precision)
    if accelerator.num_processes != ctx.world_size:  # no DDP: the ranks would train apart
        raise RunnerError(f"Accelerate sees {accelerator.num_processes} process(es) but this is "
                          f"rank {ctx.rank} of {ctx.world_size}: the launcher did not set RANK, "
                          "WORLD_SIZE and LOCAL_RANK")
    pad_free = recipe.train.padding_free and getattr(packer, "can_pack", False)
    policy = prepare_trainable(accelerator, model, recipe, pad_free=pad_free,
                               ckpt_optimizer=ckpt.optimizer_state if ckpt else None,
                               ckpt_scheduler=ckpt.state.scheduler if ckpt else None,
                               sharded="policy" in plan.sharded, rank=ctx.rank,
                               world=ctx.world_size, weights=weights)
    engine = ((actors.rollout_engine(ctx) if remote and actors is not None
               else make_engine(recipe, model_dir, dtype=precision.engine_dtype,
                                max_model_len=limit.max_model_len if limit else None))
              if generates else None)
    rollout = (Rollout(engine, engine_packer, limit, build_env_runner(recipe, engine_packer))
               if generates else None)
    svc = RunServices(recipe=recipe, plan=plan, rank=ctx, comm=comm, reporter=reporter,
                      metrics=_metrics_log(plan, ctx, ckpt), precision=precision,
                      accelerator=accelerator, stop_poll=stop, lock=lock)
    reason = held_out_reason(recipe.data, spec_of(recipe).stream)
    if reason:
        reporter.message(f"held-out evaluation: {reason}")
    assert streamed is not None and data is not None  # the handshake raised otherwise
    state = RunState(start_step=start_step, ckpt=ckpt, data=data, parts=parts,
                     val_items=streamed.held_out_items, has_held_out=streamed.has_held_out)
    run = RunContext(svc=svc, state=state, model_path=base, tokenizer=tokenizer, policy=policy,
                     policy_packer=packer, rollout=rollout, actors=actors)
    run = attrs.evolve(run, roles=build_roles(run))
    run = attrs.evolve(run, producer=build_producer(run))
    # A rollout actor, and any engine under LoRA (a checkpoint holds adapters only), starts from
    # the base model.
    if rollout is not None and ckpt is not None and (remote or lora):
        run.sync_weights()
    if ctx.is_main:  # last: a run that fails to build leaves no tracker run open
        run.svc.metrics.trackers = start_trackers(recipe, plan, ckpt, reporter, overrides, source)
    return run


def _metrics_log(plan: RunPlan, ctx: RankContext, ckpt: LoadedCheckpoint | None) -> MetricsLog:
    """The run's metrics log, continuing a checkpoint's rows; rank 0's alone writes files."""
    return MetricsLog(plan.metrics_path if ctx.is_main else None,
                      ckpt.metrics_rows if ckpt else [])


def start_trackers(recipe: Recipe, plan: RunPlan, ckpt: LoadedCheckpoint | None,
                   reporter: Reporter, overrides: Sequence[str], source: str) -> Trackers | None:
    """Rank 0's trackers (logging.report_to), continuing the runs the checkpoint names; each
    tracker run's config is the resolved recipe, as recipe.resolved.toml holds it."""
    if recipe.logging.tensorboard:
        reporter.message('logging.tensorboard is deprecated: list "tensorboard" in '
                         "logging.report_to instead")
    names = trackers_of(recipe.logging)
    if not names:
        return None
    setup = TrackerSetup(plan.output_dir, recipe.run.name, recipe.logging.project,
                         resolved_document(recipe, overrides, source))
    return Trackers(names, setup, resume=ckpt.state.trackers if ckpt else None,
                    rows=ckpt.metrics_rows if ckpt else [], say=reporter.message)


def build_producer(run: RunContext) -> Producer | None:
    """The producer of the batches the plan samples ahead (``plan.ahead`` steps, each the
    plan's items with their samples), holding those a checkpoint left in flight; None for a
    synchronous run. Its sampler reads the run's data, rollout and services, which the
    finished run shares with the one given here."""
    plan = run.svc.plan
    if not plan.samples_online:
        return None
    per_item = plan.samples_per_step // plan.items_per_step
    return make_producer(run, lambda step: sample_ahead(run, plan.items_per_step, per_item, step),
                         plan.ahead)


def build_roles(run: RunContext) -> Roles:
    """The roles of ``run.svc.plan.roles`` besides the policy and the rollout, built in the
    plan's order (the reference, the critic, the teacher, the reward functions)."""
    recipe, wanted = run.svc.recipe, run.svc.plan.roles
    reference = (run.frozen("reference", run.model_path, run.policy.pad_free)
                 if "reference" in wanted else None)
    critic = None
    if "critic" in wanted:
        from runner.train.critic import build_critic

        critic = build_critic(recipe, run.model_path, run.svc.accelerator, run.state.ckpt,
                              sharded="critic" in run.svc.plan.sharded,
                              rank=run.svc.rank.rank, world=run.svc.rank.world_size)
    teacher = build_teacher(run) if "teacher" in wanted else None
    rewards = build_rewards(recipe.reward) if "reward" in wanted else None
    return Roles(reference, critic, teacher, rewards)


def build_teacher(run: RunContext) -> Teacher:
    """OPD's teacher: its frozen model (here or in its actor) and, in cross_token_multimodal
    mode, its own packer and a student-codec packer from the student's factory."""
    from runner.models import read_model_type, resolve_model_path
    from runner.models.vocab import check_same_vocab
    from runner.packers import build_packer

    recipe = run.svc.recipe
    algo, m = recipe.algo, recipe.model
    path = resolve_model_path(algo.teacher_path, key="algo.teacher_path")
    same = algo.mode == "same_tokenizer"
    frozen = run.frozen("teacher", path, run.policy.pad_free and same)
    device, pad = run.svc.accelerator.device, run.policy_packer.pad_token_id
    if same:
        check_same_vocab(run.model_path, path, trust_remote_code=m.trust_remote_code)
        return Teacher(frozen, algo.mode, device, pad)
    packer = build_packer(path, read_model_type(path), recipe.data_packer.teacher_model_factory,
                          key="data_packer.teacher_model_factory",
                          trust_remote_code=m.trust_remote_code, dtype=m.dtype)
    return Teacher(frozen, algo.mode, device, pad, student_codec=run.build_packer(),
                   packer=packer)


def _with_adapters(model: Any, recipe: Recipe, ckpt: LoadedCheckpoint | None,
                   reporter: Reporter) -> Any:
    from runner.train.lora import apply_lora, load_adapters, trainable_share

    model = apply_lora(model, recipe.model.lora, recipe.run.seed)
    if ckpt is not None:
        load_adapters(model, ckpt.model_dir)
    n, total = trainable_share(model)
    reporter.message(f"LoRA rank {recipe.model.lora.rank}: {n:,} of {total:,} parameters train "
                     f"({100 * n / total:.2f}%)")
    return model


def _trained(model: Any, recipe: Recipe) -> Any:
    return disable_dropout(model) if recipe.train.disable_dropout else model


def _model_folders(recipe: Recipe, roles: Sequence[str], base: Path) -> dict[str, Path]:
    """The model folders every rank must hold identically, by role: the policy's, and those of
    the teacher and the critic where ``roles`` (the plan's) lists them and ``algo.ROLE_path``
    names one (a critic without its own folder starts from the policy's)."""
    from runner.models import resolve_model_path

    folders = {"policy": base}
    for role in ("teacher", "critic"):
        path = getattr(recipe.algo, f"{role}_path", "") if role in roles else ""
        if path:
            folders[role] = resolve_model_path(path, key=f"algo.{role}_path")
    return folders
