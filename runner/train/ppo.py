"""The PPO loop (Schulman et al. 2017; Ouyang et al. 2022 for the per-token KL penalty).

Roles (built by the assembly): the policy, a frozen reference (the starting policy; only with
``kl_coef > 0``), and a critic (``runner.train.critic``). The rollout-side
packer builds each sequence's inputs once; the policy, reference and critic all read that same
trajectory batch, so no role re-tokenises. Advantages come from GAE over per-token rewards
(-kl_coef x (logp - logp_ref), plus the sequence score at its last token).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from runner.algorithms.grpo import engine_is_weights
from runner.algorithms.masked import masked_sum
from runner.algorithms.ppo import PPOLossInputs, ppo_advantages, ppo_loss
from runner.recipe.schema import PPOConfig
from runner.rewards import RewardSet
from runner.train.assemble import RunContext, step_seed
from runner.train.batches import (
    Layout,
    gather_rows,
    minibatches,
    rank_mean,
    reduce_history,
    select_rows,
    train_minibatch,
)
from runner.train.critic import CRITIC
from runner.train.loop import run_loop
from runner.train.policy import completion_grid
from runner.train.roles import Trainable
from runner.train.rollouts import evaluate, item_ids_metric, sample, score


def run(run: RunContext) -> dict[str, Any]:
    algo = run.recipe.algo
    assert isinstance(algo, PPOConfig)
    rewards, critic = run.roles.rewards, run.roles.critic
    assert rewards is not None and critic is not None
    return run_loop(run, lambda step: _one_step(run, algo, rewards, critic, step),
                    (lambda: evaluate(run, rewards)) if run.has_held_out else None,
                    save=lambda step: run.save(step, {CRITIC: critic}))


def global_whiten(comm, x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``masked_whiten`` over the masked elements of every rank: the unbiased variance of the
    global batch, (x - mean) / sqrt(var + 1e-8), 0 outside the mask."""
    total, count = comm.sum([float(masked_sum(x_BT, mask_BT)), float(mask_BT.sum())])
    mean = total / count
    sq = comm.sum([float(masked_sum((x_BT - mean) ** 2, mask_BT))])[0]
    var = sq / max(1.0, count - 1)
    return torch.where(mask_BT, (x_BT - mean) * (var + 1e-8) ** -0.5, torch.zeros_like(x_BT))


def _one_step(run: RunContext, algo: PPOConfig, rewards: RewardSet, critic: Trainable,
              step: int) -> dict[str, Any]:
    recipe, device = run.recipe, run.accelerator.device
    t0 = time.perf_counter()
    traj = sample(run, algo.prompts_per_step, algo.samples_per_prompt, step)
    t1 = time.perf_counter()
    traj = score(traj, rewards, step)
    t2 = time.perf_counter()
    # The rollout-side packer makes the inputs once; policy, reference and critic share them.
    inputs = traj.policy_inputs(run.rollout_packer)
    batch = run.rollout_packer.collate(inputs).to(device)
    temperature, reference = recipe.rollout.temperature, run.roles.reference
    with torch.no_grad():
        old_BT, mask_BT = run.policy.logprobs(batch, temperature)
        engine_BT = completion_grid(inputs, [c.logprobs for c in traj.completions],
                                    old_BT.shape[1]).to(device)
        # The policy's logprobs before the update against the engine's of the same tokens.
        gap = float(((engine_BT - old_BT).abs() * mask_BT).max()) if mask_BT.any() else 0.0
        is_BT = (engine_is_weights(old_BT, engine_BT, algo.engine_is_cap)
                 if algo.engine_is_correction else None)
        ref_BT = reference.logprobs(batch, temperature)[0] if reference is not None else old_BT
        old_values_BT = critic(batch) * mask_BT
        # GAE over each completion's run of the batch grid; whitening over every rank's batch.
        adv_BT, returns_BT = ppo_advantages(
            torch.tensor(traj.rewards, device=device), old_BT, ref_BT, old_values_BT, mask_BT,
            algo, whiten=lambda x, m: global_whiten(run.comm, x, m))
    layout = Layout(run.rank.rank, run.rank.world_size, algo.prompts_per_step, algo.samples_per_prompt)
    weights = gather_rows(run.comm, layout, [float(t) for t in mask_BT.sum(-1).tolist()])

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        sub = select_rows(batch, idx)
        lp_BT, sub_mask_BT = run.policy.logprobs(sub, temperature)
        w = lp_BT.shape[1]
        return ppo_loss(PPOLossInputs(
            logprobs_BT=lp_BT, old_logprobs_BT=old_BT[idx, :w], adv_BT=adv_BT[idx, :w],
            mask_BT=sub_mask_BT, values_BT=critic(sub), old_values_BT=old_values_BT[idx, :w],
            returns_BT=returns_BT[idx, :w],
            is_weights_BT=None if is_BT is None else is_BT[idx, :w]), algo)

    history = []
    for epoch in range(algo.ppo_epochs):
        for mb in minibatches(layout, weights, algo.minibatches,
                              step_seed(recipe.run.seed, step, salt=1 + epoch)):
            history.append(train_minibatch([run.policy, critic], mb, loss_fn,
                                           recipe.train.grad_accum_steps, layout.world,
                                           recipe.train.max_grad_norm))
    run.policy.scheduler.step()
    critic.scheduler.step()
    t3 = time.perf_counter()
    run.sync_weights()
    t4 = time.perf_counter()
    kl_sum, n_tok = run.comm.sum([float(((old_BT - ref_BT) * mask_BT).sum()), float(mask_BT.sum())])
    r = torch.tensor(gather_rows(run.comm, layout, traj.rewards))
    return {"reward/mean": float(r.mean()), "reward/max": float(r.max()),
            **rank_mean(run.comm, traj.reward_parts),
            **rank_mean(run.comm, run.policy.padding_metrics(batch)),
            "kl": kl_sum / max(1.0, n_tok), "rollout/logprob_gap": max(run.comm.gather(gap)),
            "lr": run.policy.scheduler.get_last_lr()[0], **reduce_history(run.comm, history),
            **item_ids_metric(traj),
            "time/rollout": t1 - t0, "time/reward": t2 - t1, "time/update": t3 - t2, "time/sync": t4 - t3,
            "perf/rollout_tok_s": traj.n_tokens / max(t1 - t0, 1e-9)}
