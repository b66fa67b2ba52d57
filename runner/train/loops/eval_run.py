"""``posttrain-run eval`` on one rank: the recipe's held-out prompts, this rank's share of them,
sampled ``eval.num_samples`` times through the recipe's engine and DataPacker, scored by the
recipe's reward functions; rank 0 gathers every prompt's results, computes the metrics and
writes ``eval.json``.

The model is the recipe's (``model.path``) or a checkpoint of its run: a full fine-tune's
checkpoint folder is what the engine loads; a LoRA checkpoint's adapters are merged into the
base weights and pushed to the engine, as is any checkpoint an engine outside this rank (a Ray
rollout actor, started from the base model) serves. Nothing of the run is written but the eval
folder, and the run folder is not locked: a checkpoint can be evaluated while its run trains.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.precision import device_type, resolve
from runner.ranks.collective import Collective, interleave
from runner.ranks.context import RankContext
from runner.recipe.plan import RunPlan
from runner.recipe.resolved import recipe_hash
from runner.recipe.schema import Recipe
from runner.rewards import RewardSet, build_rewards
from runner.rewards.passk import pass_function, pass_ks
from runner.state.layout import MODEL_DIR
from runner.state.run_folder import no_follow, writing
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
from runner.train.loops.rollouts import generate_held_out, prompt_passes
from runner.train.roles import RoleProvider, Rollout
from runner.types import ObsBundle
from runner.ui import Reporter, SilentReporter, make_reporter

CHUNK = 32  # prompts per generation call: the progress bar moves once per chunk
RESULT = "eval.json"


def run_eval(recipe: Recipe, plan: RunPlan, *, ctx: RankContext, comm: Collective,
             job: dict[str, Any], plain: bool, actors: RoleProvider | None = None) -> int:
    """Evaluate on this rank; rank 0 writes ``job["out_dir"]/eval.json`` and shows the table."""
    with make_reporter(plain) if ctx.is_main else SilentReporter() as reporter:
        rollout, items, rewards = _build(recipe, ctx, comm, job, actors)
        try:
            mine = _evaluate(recipe, ctx, rollout, items, rewards, job, reporter)
            everyone = interleave(comm.gather(mine))
            if ctx.is_main:
                result = summarize(recipe, everyone, job, rewards.names)
                path = Path(job["out_dir"]) / RESULT
                _write(path, result)
                reporter.finish(table_rows(result, path))
            comm.barrier()
        finally:
            rollout.close()
    return 0


def _build(recipe: Recipe, ctx: RankContext, comm: Collective, job: dict[str, Any],
           actors: RoleProvider | None) -> tuple[Rollout, list[ObsBundle], RewardSet]:
    """This rank's engine (with the evaluated weights), held-out items and reward functions,
    built as a run builds them (``runner.train.assembly.build``); the ranks compare what they built
    before the engine starts, as a run's do."""
    from runner.train.roles.policy import checkpoint_policy

    precision = resolve(recipe, device_type(recipe))
    seed_everything(recipe.run.seed, recipe.run.deterministic)
    ckpt = Path(job["checkpoint"]) if job.get("checkpoint") else None
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
    rewards = step("reward", lambda: build_rewards(recipe.reward))
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
              rewards: RewardSet, job: dict[str, Any], reporter: Reporter
              ) -> list[dict[str, Any]]:
    """This rank's prompts, in chunks (the progress moves per chunk): one record each."""
    chunks = math.ceil(len(items) / CHUNK)
    n = recipe.eval.num_samples if recipe.eval.temperature > 0 else 1
    reporter.start(f"eval {job['label']}: {len(items)} prompts x {n} (this rank)", chunks, 0)
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
            if job.get("save_completions"):
                record["completions"] = held.texts[own]
            records.append(record)
        reporter.step(c + 1, {})
    return records


def summarize(recipe: Recipe, records: list[dict[str, Any]], job: dict[str, Any],
              names: Sequence[str]) -> dict[str, Any]:
    """eval.json: what was evaluated, how, the metrics over every prompt and each prompt's
    results. Rewards are means over every completion; pass@k and maj@n means over prompts;
    with [env] the env reward and each episode number (``env/turns``, ...) means over every
    episode, and each prompt's ``episodes``."""
    completions = [r for rec in records for r in rec["rewards"]]
    metrics = {"reward": sum(completions) / max(1, len(completions))}
    for name in names:
        values = [v for rec in records for v in rec["reward_of"][name]]
        metrics[f"reward/{name}"] = sum(values) / max(1, len(values))
    episodes = [e for rec in records for e in rec.get("episodes", [])]
    if episodes:
        values = [v for rec in records for v in rec["reward_of"]["env"]]
        metrics["reward/env"] = sum(values) / len(values)
        for key in sorted({k for e in episodes for k in e}):
            metrics[f"env/{key}"] = sum(e.get(key, 0.0) for e in episodes) / len(episodes)
    scored = [rec["scores"] for rec in records if "scores" in rec]
    for key in scored[0] if scored else {}:
        if key.startswith("maj@") and key.endswith("@1"):
            continue  # one completion: its majority is itself
        metrics[key] = sum(s[key] for s in scored) / len(scored)
    cfg = recipe.eval
    n = cfg.num_samples if cfg.temperature > 0 else 1
    return {
        "model": recipe.model.path, "checkpoint": job.get("checkpoint") or None,
        "step": job.get("step"), "recipe_hash": recipe_hash(recipe),
        "algo": recipe.algo.kind, "prompts": len(records), "num_samples": n,
        "temperature": cfg.temperature,
        "max_new_tokens": cfg.max_new_tokens or recipe.rollout.max_new_tokens,
        "pass_reward": pass_function(recipe.reward, cfg) or None,
        "pass_threshold": cfg.pass_threshold, "pass_at": list(pass_ks(cfg)) if n > 1 else [1],
        "metrics": metrics, "items": sorted(records, key=lambda rec: rec["index"]),
    }


def table_rows(result: dict[str, Any], path: Path) -> list[tuple[str, str]]:
    where = result["checkpoint"] or result["model"]
    rows = [("evaluated", str(where)),
            ("prompts", f"{result['prompts']} x {result['num_samples']} completion(s), "
                        f"temperature {result['temperature']:g}")]
    rows += [(key, f"{value:.4f}") for key, value in result["metrics"].items()]
    rows.append((RESULT, str(path)))
    return rows


def _write(path: Path, result: dict[str, Any]) -> None:
    """eval.json, complete or not at all (written beside it, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with writing("the evaluation", path, role="eval"):
        with open(tmp, "w", encoding="utf-8", opener=no_follow) as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
