"""``posttrain-run eval`` on one rank: the recipe's held-out prompts, this rank's share of them,
sampled ``eval.num_samples`` times through the recipe's engine and DataPacker, scored by the
recipe's reward functions; rank 0 gathers every prompt's results, computes the metrics and
writes ``eval.json`` (``runner.eval.result``).

The model is the recipe's (``model.path``) or a checkpoint of its run: a full fine-tune's
checkpoint folder is what the engine loads; a LoRA checkpoint's adapters are merged into the
base weights and pushed to the engine, as is any checkpoint an engine outside this rank (a Ray
rollout actor, started from the base model) serves. Nothing of the run is written but the eval
folder, and the run folder is not locked: a checkpoint can be evaluated while its run trains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from runner.errors import RunnerError
from runner.eval.job import EvalJob
from runner.eval.result import RESULT, summarize, table_rows, write_result
from runner.precision import device_type, resolve
from runner.ranks.collective import Collective, interleave
from runner.ranks.context import RankContext
from runner.recipe.schema import Recipe
from runner.rewards import RewardSet, build_rewards
from runner.rewards.passk import pass_function
from runner.state.layout import MODEL_DIR
from runner.train.assembly.build import (
    BuildSteps,
    open_model,
    packer_for,
    prompt_limit,
    rollout_for,
    serves_rollout,
)
from runner.train.assembly.handshake import handshake, model_files_hash
from runner.train.assembly.seeds import seed_everything
from runner.train.assembly.streams import open_data
from runner.train.loops.held_out import generate_held_out, prompt_passes
from runner.train.roles import RoleProvider, Rollout
from runner.types import ObsBundle
from runner.ui import Reporter, SilentReporter, make_reporter

CHUNK = 32  # prompts per generation call: the progress bar moves once per chunk


def run_eval(recipe: Recipe, job: EvalJob, *, ctx: RankContext, comm: Collective, plain: bool,
             actors: RoleProvider | None = None) -> int:
    """Evaluate on this rank; rank 0 writes ``job.out_dir/eval.json`` and shows the table;
    returns the exit code (0)."""
    with make_reporter(plain) if ctx.is_main else SilentReporter() as reporter:
        rollout, items, rewards = _build(recipe, ctx, comm, job, actors)
        try:
            mine = _evaluate(recipe, ctx, rollout, items, rewards, job, reporter)
            everyone = interleave(comm.gather(mine))
            if ctx.is_main:
                result = summarize(recipe, everyone, job, rewards.names)
                path = job.out_dir / RESULT
                write_result(path, result)
                reporter.finish(table_rows(result, path))
            comm.barrier()
        finally:
            rollout.close()
    return 0


def _build(recipe: Recipe, ctx: RankContext, comm: Collective, job: EvalJob,
           actors: RoleProvider | None) -> tuple[Rollout, list[ObsBundle], RewardSet]:
    """This rank's engine (with the evaluated weights), held-out items and reward functions,
    built as a run builds them (``runner.train.assembly.build``); the ranks compare what they built
    before the engine starts, as a run's do."""
    from runner.train.roles.policy import checkpoint_policy

    precision = resolve(recipe, device_type(recipe))
    seed_everything(recipe.run.seed, recipe.run.deterministic)
    ckpt = job.checkpoint
    step = BuildSteps()
    opened = step("data", lambda: open_data(recipe, ctx))
    streamed = step("data", lambda: opened.stream(recipe, ctx, None))
    folder = open_model(recipe, step)
    packer = step("rollout", lambda: packer_for(recipe, folder))
    remote = serves_rollout(actors)
    limit = step("rollout", lambda: prompt_limit(recipe, folder.path, packer, folder.codec,
                                                 opened, streamed, remote=remote))
    lora = recipe.model.lora.rank > 0
    engine_dir = (ckpt / MODEL_DIR if ckpt is not None and not lora
                  else folder.path if folder else None)
    # Weights the engine does not load from its folder: merged adapters, or a checkpoint for an
    # engine started elsewhere from the base model (loaded by the rank that pushes them).
    push = ckpt is not None and (lora or remote)
    weights = (step("policy", lambda: checkpoint_policy(recipe, ckpt))
               if push and (ctx.is_main or not remote) else None)
    rewards = step("reward", lambda: build_rewards(
        recipe.reward, device=comm.device, dtype=recipe.model.dtype,
        trust_remote_code=recipe.model.trust_remote_code))
    hashes = (step("policy", lambda: model_files_hash({"policy": engine_dir}))
              if ctx.world_size > 1 else {})
    handshake(comm, ctx, step.failed, "", hashes)
    assert streamed is not None and rewards is not None and engine_dir is not None
    if not streamed.has_held_out:
        raise RunnerError("the recipe has no held-out set to evaluate on")
    rollout = rollout_for(recipe, ctx, actors, engine_dir, precision, packer, limit)
    if weights is not None:
        rollout.update_weights((n, w.detach()) for n, w in weights.named_parameters())
    if push and rollout.shared:
        comm.barrier()  # no rank samples before the shared engine has the weights
    return rollout, streamed.held_out_items, rewards


def _evaluate(recipe: Recipe, ctx: RankContext, rollout: Rollout, items: Sequence[ObsBundle],
              rewards: RewardSet, job: EvalJob, reporter: Reporter
              ) -> list[dict[str, Any]]:
    """This rank's prompts, in chunks (the progress moves per chunk): one record each."""
    chunks = math.ceil(len(items) / CHUNK)
    n = recipe.eval.num_samples if recipe.eval.temperature > 0 else 1
    reporter.start(f"eval {job.label}: {len(items)} prompts x {n} (this rank)", chunks, 0)
    fn = pass_function(recipe.reward, recipe.eval)
    records = []
    for c in range(chunks):
        first = c * CHUNK
        held = generate_held_out(rollout, recipe, items[first:first + CHUNK], rewards,
                                 ctx.rank, ctx.world_size, first=first)
        for i, item in enumerate(held.items):
            own = held.of_item(i)
            record = {"index": (first + i) * ctx.world_size + ctx.rank, "id": item.id,
                      "reference": item.reference, "rewards": held.totals[own],
                      "reward_of": {k: v[own] for k, v in held.values_of.items()}}
            if isinstance(item.prompt, str):
                record["prompt"] = item.prompt
            if fn:
                record["passed"], record["scores"] = prompt_passes(recipe, held, i)
            if held.episodes:
                record["episodes"] = held.episodes[own]
            if job.save_completions:
                record["completions"] = held.texts[own]
            records.append(record)
        reporter.step(c + 1, {})
    return records
