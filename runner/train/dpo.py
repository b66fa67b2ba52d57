"""The DPO loop (Rafailov et al. 2023): offline preference pairs, a frozen reference, no rollouts.

Each step takes ``pairs_per_step`` pairs from the DatasetPreferenceEnv cursor, packs chosen and
rejected behind one shared prompt encoding, runs them through the policy in one concatenated
forward, and minimises the preference loss against the reference's logprobs (computed per batch,
or once for the whole dataset when ``precompute_reference = true``). Held-out: preference
accuracy (implied reward of chosen > rejected; ties count half) and loss over the full set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from runner.algorithms.dpo import DPOLossInputs, dpo_loss
from runner.packers.base import RLPolicyInput
from runner.recipe.plan import RunPlan
from runner.recipe.schema import DPOConfig, Recipe
from runner.train.grpo import mean_metrics
from runner.train.loop import run_loop
from runner.train.policy import batch_logprobs, optimizer_step, split_even
from runner.train.session import (
    Trainable,
    announce,
    find_resume,
    make_accelerator,
    metrics_log,
    prepare_trainable,
    restore_state,
    resume_cursor,
    seed_everything,
    start_output,
    write_checkpoint,
)
from runner.types import ObsBundle
from runner.ui import Reporter


@attrs.define
class DPORun:
    recipe: Recipe
    algo: DPOConfig
    env: Any  # runner.data.preference.DatasetPreferenceEnv
    packer: Any
    policy: Trainable
    reference: Any
    accelerator: Any
    cache: dict[str, tuple[float, float]]  # pair id -> reference (chosen, rejected) logprobs


def sequence_logprobs(model: Any, packer: Any, inputs: Sequence[RLPolicyInput], device: Any) -> torch.Tensor:
    """Summed completion-token logprobs of each sequence: [len(inputs)]."""
    lp_BT, mask_BT = batch_logprobs(model, packer.collate(inputs).to(device))
    return (lp_BT * mask_BT).sum(-1)


def _pack(packer: Any, pairs: Sequence[Any]) -> list[RLPolicyInput]:
    """[chosen_0 .. chosen_n, rejected_0 .. rejected_n]: one concatenated batch."""
    both = [packer.get_preference_input(ObsBundle(p.prompt), p.chosen, p.rejected) for p in pairs]
    return [c for c, _ in both] + [r for _, r in both]


@torch.no_grad()
def reference_logprobs(run: DPORun, pairs: Sequence[Any], inputs: Sequence[RLPolicyInput]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(pairs)
    if run.algo.precompute_reference and all(p.id in run.cache for p in pairs):
        values = torch.tensor([run.cache[p.id] for p in pairs], device=run.accelerator.device)
        return values[:, 0], values[:, 1]
    lp = sequence_logprobs(run.reference, run.packer, inputs, run.accelerator.device)
    return lp[:n], lp[n:]


def precompute(run: DPORun, reporter: Reporter) -> None:
    """Reference logprobs of every training and held-out pair, once (they never change)."""
    pairs = [run.env.train.pair(i) for i in range(len(run.env.train))] + run.env.validation_pairs()
    reporter.message(f"precomputing reference logprobs for {len(pairs)} pairs")
    for chunk in split_even(len(pairs), max(1, len(pairs) // 64)):
        part = pairs[chunk]
        chosen, rejected = reference_logprobs(run, part, _pack(run.packer, part))
        run.cache.update({p.id: (float(c), float(r)) for p, c, r in zip(part, chosen, rejected, strict=True)})


def one_step(run: DPORun, step: int) -> dict[str, Any]:
    recipe, algo, acc = run.recipe, run.algo, run.accelerator
    t0 = time.perf_counter()
    pairs = run.env.next_batch(algo.pairs_per_step)
    history: list[dict[str, float]] = []

    def loss_fn(rows: slice) -> torch.Tensor:
        part = pairs[rows]
        inputs = _pack(run.packer, part)
        ref_c, ref_r = reference_logprobs(run, part, inputs)
        lp = sequence_logprobs(run.policy.model, run.packer, inputs, acc.device)
        loss, m = dpo_loss(DPOLossInputs(policy_chosen_B=lp[:len(part)], policy_rejected_B=lp[len(part):],
                                         ref_chosen_B=ref_c, ref_rejected_B=ref_r), algo)
        history.append(m)
        return loss * len(part) / len(pairs)

    micro = split_even(len(pairs), recipe.train.grad_accum_steps)
    norm = optimizer_step(acc, run.policy.model, run.policy.optimizer,
                          [lambda r=r: loss_fn(r) for r in micro], recipe.train.max_grad_norm)
    run.policy.scheduler.step()
    return {**mean_metrics(history), "grad_norm": norm, "lr": run.policy.scheduler.get_last_lr()[0],
            "time/update": time.perf_counter() - t0}


@torch.no_grad()
def held_out(run: DPORun) -> dict[str, float]:
    pairs = run.env.validation_pairs()
    correct, losses = 0.0, []
    for chunk in split_even(len(pairs), max(1, len(pairs) // 64)):
        part = pairs[chunk]
        inputs = _pack(run.packer, part)
        ref_c, ref_r = reference_logprobs(run, part, inputs)
        lp = sequence_logprobs(run.policy.model, run.packer, inputs, run.accelerator.device)
        margin = (lp[:len(part)] - ref_c) - (lp[len(part):] - ref_r)
        correct += float((margin > 0).sum() + 0.5 * (margin == 0).sum())
        loss, _ = dpo_loss(DPOLossInputs(policy_chosen_B=lp[:len(part)], policy_rejected_B=lp[len(part):],
                                         ref_chosen_B=ref_c, ref_rejected_B=ref_r), run.algo)
        losses.append(float(loss) * len(part))
    return {"eval/preference_accuracy": correct / len(pairs), "eval/loss": sum(losses) / len(pairs)}


def run_dpo(recipe: Recipe, plan: RunPlan, reporter: Reporter, source: str,
            overrides: Sequence[str]) -> dict[str, Any]:
    from runner.data.preference import DatasetPreferenceEnv
    from runner.models import load_causal_lm, load_tokenizer, read_model_type, resolve_model_path
    from runner.packers import build_packer

    algo = recipe.algo
    assert isinstance(algo, DPOConfig)
    seed_everything(recipe.run.seed, recipe.run.deterministic)
    env = DatasetPreferenceEnv.from_recipe(recipe)
    ckpt = find_resume(recipe, plan)
    parts = env.fingerprint_parts()
    cursor = resume_cursor(recipe, ckpt, parts)  # before any model is built
    if cursor is not None:
        env = DatasetPreferenceEnv.from_recipe(recipe, cursor=cursor)
    start_output(recipe, plan, source, overrides)
    start_step = restore_state(ckpt) if ckpt else 0
    announce(reporter, recipe, start_step, ckpt)
    base = resolve_model_path(recipe.model.path)
    path = ckpt.model_dir if ckpt else base
    tokenizer = load_tokenizer(base, trust_remote_code=recipe.model.trust_remote_code)
    packer = build_packer(base, recipe.model.model_type or read_model_type(base), recipe.data_packer.factory)
    accelerator = make_accelerator(recipe)
    policy = prepare_trainable(accelerator, load_causal_lm(path, dtype=recipe.model.dtype), recipe,
                               ckpt_optimizer=ckpt.optimizer_state if ckpt else None,
                               ckpt_scheduler=ckpt.state.scheduler if ckpt else None)
    reference = load_causal_lm(base, dtype=recipe.model.dtype).requires_grad_(False).eval().to(accelerator.device)
    run = DPORun(recipe, algo, env, packer, policy, reference, accelerator, {})
    if algo.precompute_reference:
        precompute(run, reporter)
    metrics = metrics_log(recipe, plan, ckpt)

    def save(step: int) -> Any:
        return write_checkpoint(recipe, plan, step, accelerator, policy, tokenizer, env.cursor, parts, metrics)

    try:
        result = run_loop(recipe, start_step, metrics, reporter, lambda s: one_step(run, s), save,
                          (lambda: held_out(run)) if recipe.data.validation.enabled else None)
    finally:
        metrics.close()
    return result | {"metrics": metrics.rows}
