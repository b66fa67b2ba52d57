"""Rank 0's result of ``posttrain-run eval``: ``eval.json`` (what was evaluated, how, the
metrics over every prompt and each prompt's results), written whole or not at all, and the
table the reporter shows at the end."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.eval.job import EvalJob
from runner.recipe.resolved import recipe_hash
from runner.recipe.schema import Recipe
from runner.rewards.passk import pass_function, pass_ks
from runner.state.run_folder import no_follow, writing

RESULT = "eval.json"


def summarize(recipe: Recipe, records: list[dict[str, Any]], job: EvalJob,
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
        "model": recipe.model.path, "checkpoint": str(job.checkpoint) if job.checkpoint else None,
        "step": job.step, "recipe_hash": recipe_hash(recipe),
        "algo": recipe.algo.kind, "prompts": len(records), "num_samples": n,
        "temperature": cfg.temperature,
        "max_new_tokens": cfg.max_new_tokens or recipe.rollout.max_new_tokens,
        "pass_reward": pass_function(recipe.reward, cfg) or None,
        "pass_threshold": cfg.pass_threshold, "pass_at": list(pass_ks(cfg)) if n > 1 else [1],
        "metrics": metrics, "items": sorted(records, key=lambda rec: rec["index"]),
    }


def table_rows(result: dict[str, Any], path: Path) -> list[tuple[str, str]]:
    """The end-of-eval table: what was evaluated, the prompts, each metric and the file."""
    where = result["checkpoint"] or result["model"]
    rows = [("evaluated", str(where)),
            ("prompts", f"{result['prompts']} x {result['num_samples']} completion(s), "
                        f"temperature {result['temperature']:g}")]
    rows += [(key, f"{value:.4f}") for key, value in result["metrics"].items()]
    rows.append((RESULT, str(path)))
    return rows


def write_result(path: Path, result: dict[str, Any]) -> None:
    """eval.json, complete or not at all (written beside it, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with writing("the evaluation", path, role="eval"):
        with open(tmp, "w", encoding="utf-8", opener=no_follow) as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
