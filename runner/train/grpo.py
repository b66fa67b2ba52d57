"""The GRPO loop (Shao et al. 2024, DeepSeekMath): sample a group of completions per prompt,
score them, normalise rewards within each group, and take clipped policy-gradient steps.

One step: prompts from the cursor -> ``group_size`` completions each -> rewards -> advantages ->
``ppo_epochs`` x ``minibatches`` optimizer steps -> new weights to the engine -> metrics, eval,
checkpoint. Everything random is seeded from (run seed, step), so a resumed run repeats the
uninterrupted one exactly.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from runner.algorithms.grpo import GRPOLossInputs, group_advantages, grpo_loss
from runner.recipe.schema import GRPOConfig
from runner.rewards import build_rewards
from runner.train.loop import run_prompt_loop
from runner.train.policy import batch_logprobs, completion_grid, optimizer_step, split_even
from runner.train.rollouts import Trajectory, reward_side_prefixes, score
from runner.train.session import PromptRun, step_seed


def run_grpo(run: PromptRun) -> dict[str, Any]:
    algo = run.recipe.algo
    assert isinstance(algo, GRPOConfig)
    rewards = build_rewards(run.recipe.reward)
    reference = reference_model(run) if algo.kl_beta > 0 else None
    reward_packer = run.build_packer() if algo.shared_prefix_filter else None  # only when used
    return run_prompt_loop(run, lambda step: _one_step(run, algo, rewards, reference, reward_packer, step),
                           rewards)


def _one_step(run: PromptRun, algo: GRPOConfig, rewards: Any, reference: Any, reward_packer: Any,
              step: int) -> dict[str, Any]:
    recipe = run.recipe
    t0 = time.perf_counter()
    traj = run.sample(algo.prompts_per_step, algo.group_size, step)
    t1 = time.perf_counter()
    traj = score(traj, rewards, step)
    ignore = reward_side_prefixes(reward_packer, traj, algo.group_size) if reward_packer else None
    t2 = time.perf_counter()
    metrics = _update(run, algo, traj, reference, step, ignore)
    if ignore is not None:
        metrics["prefix_tokens_filtered"] = sum(ignore) / len(ignore)
    t3 = time.perf_counter()
    run.sync_weights()
    t4 = time.perf_counter()
    if recipe.logging.sample_every and step % recipe.logging.sample_every == 0:
        run.reporter.sample(step, str(traj.items[0].prompt), traj.texts[0], traj.rewards[0])
    r = torch.tensor(traj.rewards)
    return {
        "reward/mean": float(r.mean()), "reward/max": float(r.max()), **traj.reward_parts,
        "completion_len": traj.n_tokens / len(traj.completions), **metrics,
        "time/rollout": t1 - t0, "time/reward": t2 - t1, "time/update": t3 - t2, "time/sync": t4 - t3,
        "perf/rollout_tok_s": traj.n_tokens / max(t1 - t0, 1e-9),
        "perf/train_tok_s": algo.ppo_epochs * traj.n_tokens / max(t3 - t2, 1e-9),
    }


def _update(run: PromptRun, algo: GRPOConfig, traj: Trajectory, reference: Any, step: int,
            ignore_prefix: list[int] | None) -> dict[str, float]:
    recipe, acc = run.recipe, run.accelerator
    model = run.policy.model
    device = acc.device
    adv_B = group_advantages(torch.tensor(traj.rewards), algo.group_size, algo.scale_rewards)
    inputs = traj.policy_inputs(run.policy_packer, ignore_prefix)
    batch = run.policy_packer.collate(inputs).to(device)
    width = batch.input_ids_BT.shape[1] - 1
    temperature = recipe.rollout.temperature
    with torch.no_grad():
        if algo.old_logprobs == "engine":
            old_BT = completion_grid(inputs, [c.logprobs for c in traj.completions], width).to(device)
        else:
            old_BT = batch_logprobs(model, batch, temperature)[0]
        ref_BT = batch_logprobs(reference, batch, temperature)[0] if reference is not None else None
    n = len(inputs)
    history: list[dict[str, float]] = []
    for epoch in range(algo.ppo_epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(
            step_seed(recipe.run.seed, step, salt=1 + epoch)))
        for mb in split_even(n, algo.minibatches):
            rows = order[mb]
            micro = [rows[s] for s in split_even(len(rows), recipe.train.grad_accum_steps)]
            total_tokens = int(batch.loss_mask_BT[rows, 1:].sum())

            def loss_fn(idx: torch.Tensor, rows=rows, total_tokens=total_tokens) -> torch.Tensor:
                sub = select_rows(batch, idx)
                lp_BT, mask_BT = batch_logprobs(model, sub, temperature)
                w = lp_BT.shape[1]
                loss, m = grpo_loss(GRPOLossInputs(
                    logprobs_BT=lp_BT, old_logprobs_BT=old_BT[idx, :w], adv_B=adv_B[idx].to(device),
                    ref_logprobs_BT=None if ref_BT is None else ref_BT[idx, :w], mask_BT=mask_BT,
                    max_tokens=recipe.rollout.max_new_tokens), algo)
                history.append(m)
                share = (int(mask_BT.sum()) / max(1, total_tokens) if algo.loss_agg == "token_mean"
                         else len(idx) / len(rows))
                return loss * share

            grad_norm = optimizer_step(acc, model, run.policy.optimizer,
                                       [lambda i=i: loss_fn(i) for i in micro], recipe.train.max_grad_norm)
            history.append({"grad_norm": grad_norm})
    run.policy.scheduler.step()
    out = mean_metrics(history)
    out["lr"] = run.policy.scheduler.get_last_lr()[0]
    out["adv_abs_mean"] = float(adv_B.abs().mean())
    return out


def select_rows(batch: Any, idx: torch.Tensor) -> Any:
    """Rows ``idx`` of a padded batch, trimmed to their longest sequence."""
    import attrs

    width = int(batch.attention_mask_BT[idx].sum(-1).max())
    return attrs.evolve(batch, **{name: getattr(batch, name)[idx, :width] for name in
                                  ("input_ids_BT", "attention_mask_BT", "position_ids_BT",
                                   "loss_mask_BT", "seq_ids_BT")})


def mean_metrics(history: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for h in history for k in h})
    return {k: sum(h[k] for h in history if k in h) / sum(1 for h in history if k in h) for k in keys}


def reference_model(run: PromptRun) -> Any:
    """A frozen copy of the starting policy (the model the run began from, not the checkpoint)."""
    from runner.models import load_causal_lm

    ref = load_causal_lm(run.model_path, dtype=run.recipe.model.dtype,
                         trust_remote_code=run.recipe.model.trust_remote_code)
    ref.requires_grad_(False)
    return ref.eval().to(run.accelerator.device)
