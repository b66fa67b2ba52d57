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
from runner.errors import Problem, RecipeError, RunnerError
from runner.models.loading import run_folder_models
from runner.precision import Precision, resolve
from runner.ranks.collective import Collective
from runner.ranks.context import RankContext
from runner.recipe.algos import spec_of
from runner.recipe.checks import batch_key, trackers_of
from runner.recipe.held_out import held_out_reason
from runner.recipe.plan import RunPlan
from runner.recipe.resolved import resolved_document, write_resolved
from runner.recipe.schema import Recipe
from runner.rewards import build_rewards
from runner.state.layout import restore_rng
from runner.state.load import LoadedCheckpoint, load_latest
from runner.state.pick import refuse_pickled
from runner.state.run_folder import RunLock
from runner.train.assembly.build import (
    BuildSteps,
    open_model,
    packer_for,
    prompt_limit,
    rollout_for,
    serves_rollout,
)
from runner.train.assembly.handshake import check_shared_folder, handshake, model_files_hash
from runner.train.assembly.run import Roles, RunContext, RunState
from runner.train.assembly.seeds import seed_everything
from runner.train.assembly.services import RunServices
from runner.train.assembly.streams import OpenedData, Streamed, open_data
from runner.train.loops.pipeline import (
    Produced,
    Producer,
    held_in_flight,
    refuse_in_flight,
)
from runner.train.loops.rollouts import sample_ahead
from runner.train.roles import RoleProvider, prepare_trainable
from runner.train.roles.model_setup import trained_model
from runner.train.roles.teacher import Teacher
from runner.ui import MetricsLog, Reporter
from runner.ui.trackers import Trackers, TrackerSetup

if TYPE_CHECKING:
    from accelerate import Accelerator


def find_resume(recipe: Recipe, plan: RunPlan, reporter: Reporter) -> LoadedCheckpoint | None:
    """The newest intact checkpoint that loads and fits the recipe's model (damaged, unparsable
    or misfitting newer ones are skipped, saying why)."""
    from runner.train.assembly.build import recipe_check

    if recipe.checkpoint.resume == "never":
        return None
    return load_latest(plan.checkpoint_dir, on_skip=reporter.message, fits=recipe_check(recipe))


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


def check_head_lr_change(recipe: Recipe, ckpt: LoadedCheckpoint) -> None:
    """A reward model's optimizer holds the score head in a group of its own exactly when
    ``algo.head_lr`` is set: a checkpoint written the other way cannot be continued."""
    head_lr = getattr(recipe.algo, "head_lr", None)
    saved = ckpt.optimizer_state
    if head_lr is None or saved is None:
        return
    groups = len((saved.get("sharded") or saved).get("param_groups", ()))
    if (groups > 1) == (head_lr > 0):
        return
    raise RecipeError([Problem(
        "algo.head_lr", f"the checkpoint {ckpt.path.name} was written with "
        + ("the score head at its own learning rate" if groups > 1 else "one learning rate")
        + f"; algo.head_lr = {head_lr:g} "
        + ("trains it at train.lr" if head_lr == 0 else "sets one for the score head"),
        got=head_lr, hint="resume with the algo.head_lr the run was started with, or start a "
        "new run.output_dir")])


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


def make_accelerator(device: str, precision: Precision, ctx: RankContext,
                     checkpointing: bool = False) -> Accelerator:
    """Accelerate's view of this rank, which must see the launcher's world (DDP otherwise
    trains the ranks apart). With gradient checkpointing (``checkpointing``) autocast keeps no
    cache of its casts: a layer recomputed in the backward must save the tensors its forward
    saved, which a cast already cached in the forward (by an earlier layer call of the same
    autocast region) would not be; the casts give the same values either way."""
    from accelerate import Accelerator
    from accelerate.utils import AutocastKwargs

    handlers = [AutocastKwargs(cache_enabled=False)] if checkpointing else []
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision=precision.train,
                              kwargs_handlers=handlers)
    if accelerator.num_processes != ctx.world_size:
        raise RunnerError(f"Accelerate sees {accelerator.num_processes} process(es) but this is "
                          f"rank {ctx.rank} of {ctx.world_size}: the launcher did not set RANK, "
                          "WORLD_SIZE and LOCAL_RANK")
    return accelerator


@attrs.frozen(eq=False)
class Start:
    """Where a rank's run starts: the run folder's lock (rank 0's), the checkpoint it resumes
    from, the opened data, its stream resumed at the saved cursor, and the step."""

    lock: RunLock | None
    ckpt: LoadedCheckpoint | None
    opened: OpenedData | None
    parts: dict[str, str]
    streamed: Streamed | None
    step: int


def open_start(recipe: Recipe, plan: RunPlan, ctx: RankContext, reporter: Reporter,
               step: BuildSteps, overrides: Sequence[str], source: str) -> Start:
    """Lock the run folder (rank 0), find the checkpoint, open the data and check the saved
    cursor against it before any model is built; rank 0 writes the resolved recipe; the
    checkpoint's RNG state is restored."""
    # The writer locks the run folder before reading its checkpoints: a second run on the same
    # folder stops here, before it reads or writes anything there.
    lock = step("output", lambda: RunLock.acquire(plan.output_dir)) if ctx.is_main else None
    ckpt = step("checkpoint", lambda: find_resume(recipe, plan, reporter))
    if ckpt is not None:
        step("checkpoint", lambda: check_world_change(recipe, plan, ckpt))
        step("checkpoint", lambda: check_head_lr_change(recipe, ckpt))
        step("checkpoint", lambda: refuse_pickled(ckpt))
        step("checkpoint", lambda: refuse_in_flight(ckpt, plan.ahead, plan.world_size))
    opened = step("data", lambda: open_data(recipe, ctx))
    parts = opened.fingerprint_parts() if opened else {}
    cursor = step("data", lambda: resume_cursor(recipe, ckpt, parts))  # before any model
    streamed = step("data", lambda: opened.stream(recipe, ctx, cursor))
    if ctx.is_main and step.failed is None:
        step("output", lambda: (plan.output_dir.mkdir(parents=True, exist_ok=True),
                                write_resolved(recipe, plan.resolved_path, overrides, source,
                                               run_folder_models(recipe))))
    start_step = 0
    if ckpt is not None and step.failed is None:
        restore_rng(ckpt.rng_of_rank(ctx.rank), ckpt.rng_tensors_of_rank(ctx.rank))
        start_step = ckpt.state.step
        reporter.message(f"resuming {recipe.run.name!r} from {ckpt.path} (step {start_step})")
    return Start(lock, ckpt, opened, parts, streamed, start_step)


def load_policy_model(recipe: Recipe, plan: RunPlan, ckpt: LoadedCheckpoint | None,
                      base: Path, step: BuildSteps, reporter: Reporter
                      ) -> tuple[Any, Path | None, Path]:
    """The policy's model (dropout off where the recipe says, LoRA adapters applied), the
    folder of the shards each rank reads after the handshake (sharded full fine-tuning), and
    the folder its weights come from (what an engine started here loads)."""
    from runner.models import load_causal_lm

    trust, dtype = recipe.model.trust_remote_code, recipe.model.dtype
    head = spec_of(recipe).head  # a language model, or a score head on it (a reward model)
    # With LoRA the base weights always come from the base folder; a checkpoint holds adapters.
    lora = recipe.model.lora.rank > 0
    model_dir = ckpt.model_dir if ckpt and not lora else base

    # Sharded (full fine-tuning): an empty model whose shards each rank reads after the
    # handshake, so that no rank holds the whole model (LoRA wraps a loaded one).
    def load() -> tuple[Any, Path | None]:
        if "policy" in plan.sharded and not lora:
            from runner.train.roles.sharding import load_for_sharding

            return load_for_sharding(model_dir, dtype, trust)
        return load_causal_lm(model_dir, dtype=dtype, trust_remote_code=trust, head=head), None

    model, weights = step("policy", load) or (None, None)
    model = step("policy", lambda: trained_model(model, recipe.train)) if model is not None \
        else None
    if lora and model is not None:
        model = step("policy", lambda: _with_adapters(model, recipe, ckpt, reporter))
    return model, weights, model_dir


def assemble(recipe: Recipe, plan: RunPlan, *, ctx: RankContext, comm: Collective,
             reporter: Reporter, source: str, overrides: Sequence[str],
             actors: RoleProvider | None = None, stop: Callable[[], bool] | None = None
             ) -> RunContext:
    """Build every role the plan lists (``plan.roles``), in this process or, where ``actors``
    serves it, as a handle on the launcher's role actor; the run returned is whole."""
    device = comm.device.type  # decided once per rank, where the rank joined its group
    precision = resolve(recipe, device)  # once per rank: the trained, frozen and engine dtypes
    seed_everything(recipe.run.seed, recipe.run.deterministic)
    step = BuildSteps()
    start = open_start(recipe, plan, ctx, reporter, step, overrides, source)
    folder = open_model(recipe, step)
    base = folder.path if folder else Path(recipe.model.path)
    model, weights, model_dir = load_policy_model(recipe, plan, start.ckpt, base, step, reporter)
    packer = step("policy", lambda: packer_for(recipe, folder))
    generates = "rollout" in plan.roles
    engine_packer = step("rollout", lambda: packer_for(recipe, folder)) if generates else None
    # Every rank checks every prompt it can before the run (and measures them for a derived
    # vllm max_model_len), before the handshake: a refused prompt stops every rank at once.
    limit = (step("rollout", lambda: prompt_limit(
        recipe, base, engine_packer, folder.codec, start.opened, start.streamed,
        remote=serves_rollout(actors))) if generates else None)
    data = start.streamed.data if start.streamed else None
    hashes = (step("policy", lambda: model_files_hash(_model_folders(recipe, plan.roles, base)))
              if ctx.world_size > 1 else {})
    # Before the first collective of the build (DDP's parameter broadcast, the engine's setup):
    # a rank that failed must not leave the others waiting inside one.
    handshake(comm, ctx, step.failed, data.cursor.fingerprint if data is not None else "",
              hashes)
    assert folder is not None and start.streamed is not None and data is not None
    if plan.sharded and ctx.world_size > 1:
        check_shared_folder(comm, ctx, plan.checkpoint_dir)
    accelerator = make_accelerator(device, precision, ctx, recipe.train.gradient_checkpointing)
    ckpt = start.ckpt
    policy = prepare_trainable(
        accelerator, model, recipe,
        pad_free=recipe.train.padding_free and getattr(packer, "can_pack", False),
        ckpt_optimizer=ckpt.optimizer_state if ckpt else None,
        ckpt_scheduler=ckpt.state.scheduler if ckpt else None,
        sharded="policy" in plan.sharded, rank=ctx.rank, world=ctx.world_size, weights=weights,
        head_lr=getattr(recipe.algo, "head_lr", 0.0) or None)
    rollout = (rollout_for(recipe, ctx, actors, model_dir, precision, engine_packer, limit,
                           policy) if generates else None)
    svc = RunServices(recipe=recipe, plan=plan, rank=ctx, comm=comm, reporter=reporter,
                      metrics=_metrics_log(plan, ctx, ckpt), precision=precision,
                      accelerator=accelerator, stop_poll=stop, lock=start.lock)
    state = RunState(start_step=start.step, ckpt=ckpt, data=data, parts=start.parts,
                     val_items=start.streamed.held_out_items,
                     has_held_out=start.streamed.has_held_out)
    run = RunContext(svc=svc, state=state, model_path=base, tokenizer=folder.codec,
                     policy=policy, policy_packer=packer, rollout=rollout, actors=actors)
    return finish(run, overrides, source)


def finish(run: RunContext, overrides: Sequence[str], source: str) -> RunContext:
    """The run made whole: its roles built, the engine given the weights it does not load
    itself, (rank 0) the trackers started, and the producer built on the finished services.
    The trackers start after everything that can fail: a run that fails to build leaves no
    tracker run open."""
    recipe, plan, ckpt = run.svc.recipe, run.svc.plan, run.state.ckpt
    reason = held_out_reason(recipe.data, spec_of(recipe).stream)
    if reason:
        run.svc.reporter.message(f"held-out evaluation: {reason}")
    run = attrs.evolve(run, roles=build_roles(run))
    held = (held_in_flight(ckpt, run.svc.rank.rank, run.state.data.source.item)
            if plan.ahead else [])
    # A rollout actor, and any engine under LoRA (a checkpoint holds adapters only), starts from
    # the base model.
    if run.rollout is not None and ckpt is not None and (
            serves_rollout(run.actors) or recipe.model.lora.rank > 0):
        run.sync_weights()
    trackers = (start_trackers(recipe, plan, ckpt, run.svc.reporter, overrides, source)
                if run.svc.rank.is_main else None)
    if trackers is not None:  # nothing was logged yet: the loop's log goes to them too
        metrics = MetricsLog(plan.metrics_path, run.svc.metrics.rows, trackers)
        run = attrs.evolve(run, svc=attrs.evolve(run.svc, metrics=metrics))
    return attrs.evolve(run, producer=build_producer(run, held))


def _metrics_log(plan: RunPlan, ctx: RankContext, ckpt: LoadedCheckpoint | None) -> MetricsLog:
    """The run's metrics log, continuing a checkpoint's rows; rank 0's alone writes files (and
    gets its trackers once the run is built: ``finish``)."""
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
                         resolved_document(recipe, overrides, source,
                                           run_folder_models(recipe)))
    return Trackers(names, setup, resume=ckpt.state.trackers if ckpt else None,
                    rows=ckpt.metrics_rows if ckpt else [], say=reporter.message)


def build_producer(run: RunContext, held: list[Produced]) -> Producer | None:
    """The producer of the batches the plan samples ahead (``plan.ahead`` steps, each the
    plan's items with their samples), holding ``held``, those a checkpoint left in flight;
    None for a synchronous run. Its sampler reads the run given here, which is the finished
    run's data, rollout and services."""
    plan = run.svc.plan
    if not plan.samples_online or plan.ahead == 0:
        return None
    per_item = plan.samples_per_step // plan.items_per_step
    return Producer(lambda step: sample_ahead(run, plan.items_per_step, per_item, step),
                    plan.ahead, held, threads=run.svc.recipe.rollout.producer_threads,
                    last_step=plan.max_steps)


def build_roles(run: RunContext) -> Roles:
    """The roles of ``run.svc.plan.roles`` besides the policy and the rollout, built in the
    plan's order (the reference, the critic, the teacher, the reward functions)."""
    recipe, wanted = run.svc.recipe, run.svc.plan.roles
    reference = (run.frozen("reference", run.model_path, run.policy.pad_free)
                 if "reference" in wanted else None)
    critic = None
    if "critic" in wanted:
        from runner.train.roles.critic import build_critic

        critic = build_critic(recipe, run.model_path, run.svc.accelerator, run.state.ckpt,
                              sharded="critic" in run.svc.plan.sharded,
                              rank=run.svc.rank.rank, world=run.svc.rank.world_size)
    teacher = build_teacher(run) if "teacher" in wanted else None
    rewards = build_rewards(recipe.reward, device=run.svc.accelerator.device,
                            dtype=recipe.model.dtype,
                            trust_remote_code=recipe.model.trust_remote_code,
                            served=run.actors.remote_rewards() if run.actors else None) \
        if "reward" in wanted else None
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
    from runner.train.roles.lora import apply_lora, load_adapters, trainable_share

    model = apply_lora(model, recipe.model.lora, recipe.run.seed)
    if ckpt is not None:
        load_adapters(model, ckpt.model_dir)
    n, total = trainable_share(model)
    reporter.message(f"LoRA rank {recipe.model.lora.rank}: {n:,} of {total:,} parameters train "
                     f"({100 * n / total:.2f}%)")
    return model


def _model_folders(recipe: Recipe, roles: Sequence[str], base: Path) -> dict[str, Path]:
    """The model folders every rank must hold identically, by role: the policy's, and those of
    the algorithm's other models (``AlgoSpec.models``: the teacher, a critic with a folder of
    its own) where ``roles`` (the plan's) lists them."""
    from runner.models import resolve_model_path

    folders = {"policy": base}
    for m in spec_of(recipe).models(recipe.algo):
        if m.role in roles:
            folders[m.role] = resolve_model_path(m.path, key=m.key)
    return folders
