"""The PPO loop (Schulman et al. 2017; Ouyang et al. 2022 for the per-token KL penalty).

Roles: the policy, a frozen reference (the starting policy), and a critic (a value head on a copy
of the policy's backbone, or on a separate model named by ``algo.critic_path``). The rollout-side
packer builds each sequence's inputs once; the policy, reference and critic all read that same
trajectory batch, so no role re-tokenises. Advantages come from GAE over per-token rewards
(-kl_coef x (logp - logp_ref), plus the sequence score at its last token).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from runner.algorithms.ppo import PPOLossInputs, ppo_advantages, ppo_loss
from runner.packers.base import PolicyBatch
from runner.recipe.schema import PPOConfig
from runner.rewards import build_rewards
from runner.train.grpo import mean_metrics, reference_model, select_rows
from runner.train.loop import run_prompt_loop
from runner.train.policy import batch_logprobs, split_even
from runner.train.rollouts import score
from runner.train.session import PromptRun, Trainable, prepare_trainable, step_seed

CRITIC = "critic"


class ValueModel(torch.nn.Module):
    """A transformer backbone with a scalar value head: values_BT for every position."""

    def __init__(self, backbone: Any, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.v_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.v_head.weight)
        torch.nn.init.zeros_(self.v_head.bias)

    def forward(self, batch: PolicyBatch) -> torch.Tensor:
        """Values on the shifted grid [B, T-1]: the value of the state before token t+1."""
        kwargs = {} if batch.packed else {"attention_mask": batch.attention_mask_BT}
        hidden = self.backbone(input_ids=batch.input_ids_BT, position_ids=batch.position_ids_BT,
                               use_cache=False, **kwargs).last_hidden_state
        return self.v_head(hidden[:, :-1].float()).squeeze(-1)


def build_critic(run: PromptRun) -> Trainable:
    from runner.models import load_causal_lm, resolve_model_path

    algo = run.recipe.algo
    assert isinstance(algo, PPOConfig)
    path = resolve_model_path(algo.critic_path) if algo.critic_path else run.model_path
    lm = load_causal_lm(path, dtype=run.recipe.model.dtype,
                        trust_remote_code=run.recipe.model.trust_remote_code)
    critic = ValueModel(lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model,
                        lm.config.hidden_size)
    if run.ckpt is not None:
        critic.load_state_dict(run.ckpt.extra_state(CRITIC))
    saved = run.ckpt.state.extra.get(CRITIC, {}) if run.ckpt else {}
    return prepare_trainable(run.accelerator, critic, run.recipe, lr=algo.critic_lr or None,
                             ckpt_optimizer=run.ckpt.extra_optimizer_state(CRITIC) if run.ckpt else None,
                             ckpt_scheduler=saved.get("scheduler"))


def run_ppo(run: PromptRun) -> dict[str, Any]:
    algo = run.recipe.algo
    assert isinstance(algo, PPOConfig)
    rewards = build_rewards(run.recipe.reward)
    reference = reference_model(run)
    critic = build_critic(run)

    def save(step: int) -> Any:
        return run.save(step, {CRITIC: run.accelerator.unwrap_model(critic.model)}, {CRITIC: critic})

    return run_prompt_loop(run, lambda step: _one_step(run, algo, rewards, reference, critic, step),
                    rewards, save)


def _one_step(run: PromptRun, algo: PPOConfig, rewards: Any, reference: Any, critic: Trainable,
              step: int) -> dict[str, Any]:
    recipe, acc = run.recipe, run.accelerator
    t0 = time.perf_counter()
    traj = run.sample(algo.prompts_per_step, algo.samples_per_prompt, step)
    t1 = time.perf_counter()
    traj = score(traj, rewards, step)
    t2 = time.perf_counter()
    # The rollout-side packer makes the inputs once; policy, reference and critic share them.
    batch = run.rollout_packer.collate(traj.policy_inputs(run.rollout_packer)).to(acc.device)
    T = recipe.rollout.temperature
    with torch.no_grad():
        old_BT, mask_BT = batch_logprobs(run.policy.model, batch, T)
        ref_BT = batch_logprobs(reference, batch, T)[0]
        old_values_BT = critic.model(batch) * mask_BT
        # GAE runs over completions laid from column 0; the results go back to the batch grid.
        starts = _completion_starts(mask_BT)
        aligned = [_left_align(x, starts) for x in (old_BT, ref_BT, old_values_BT, mask_BT.float())]
        adv_c, returns_c = ppo_advantages(torch.tensor(traj.rewards, device=acc.device), aligned[0],
                                          aligned[1], aligned[2], aligned[3].bool(), algo)
        adv_BT = _restore(adv_c, starts, old_BT.shape[1])
        returns_BT = _restore(returns_c, starts, old_BT.shape[1])
    history: list[dict[str, float]] = []
    n = len(traj.completions)
    for epoch in range(algo.ppo_epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(
            step_seed(recipe.run.seed, step, salt=1 + epoch)))
        for mb in split_even(n, algo.minibatches):
            rows = order[mb]
            history.append(_minibatch(run, critic, algo, batch, rows, old_BT, adv_BT, old_values_BT,
                                      returns_BT))
    run.policy.scheduler.step()
    critic.scheduler.step()
    t3 = time.perf_counter()
    run.sync_weights()
    t4 = time.perf_counter()
    kl = float(((old_BT - ref_BT) * mask_BT).sum() / mask_BT.sum().clamp(min=1))
    r = torch.tensor(traj.rewards)
    return {"reward/mean": float(r.mean()), "reward/max": float(r.max()), **traj.reward_parts,
            "kl": kl, **mean_metrics(history),
            "time/rollout": t1 - t0, "time/reward": t2 - t1, "time/update": t3 - t2, "time/sync": t4 - t3,
            "perf/rollout_tok_s": traj.n_tokens / max(t1 - t0, 1e-9)}


def _completion_starts(mask_BT: torch.Tensor) -> torch.Tensor:
    """Column of each row's first completion token on the shifted grid (0 for an empty row)."""
    return torch.where(mask_BT.any(-1), mask_BT.int().argmax(-1), torch.zeros_like(mask_BT[:, 0], dtype=torch.long))


def _left_align(x_BT: torch.Tensor, starts_B: torch.Tensor) -> torch.Tensor:
    """Row b shifted left by starts_B[b] (zeros fill the right end)."""
    T = x_BT.shape[1]
    cols = torch.arange(T, device=x_BT.device)[None, :] + starts_B[:, None]
    return torch.where(cols < T, x_BT.gather(1, cols.clamp(max=T - 1)), torch.zeros_like(x_BT))


def _restore(x_BT: torch.Tensor, starts_B: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of _left_align, back onto a grid of ``width`` columns."""
    cols = torch.arange(width, device=x_BT.device)[None, :] - starts_B[:, None]
    valid = cols >= 0
    return torch.where(valid, x_BT.gather(1, cols.clamp(min=0)), torch.zeros_like(x_BT[:, :1]).expand(-1, width))


def _minibatch(run: PromptRun, critic: Trainable, algo: PPOConfig, batch: PolicyBatch,
               rows: torch.Tensor, old_BT, adv_BT, old_values_BT, returns_BT) -> dict[str, float]:
    acc, recipe = run.accelerator, run.recipe
    sub = select_rows(batch, rows)
    lp_BT, mask_BT = batch_logprobs(run.policy.model, sub, recipe.rollout.temperature)
    w = lp_BT.shape[1]
    loss, metrics = ppo_loss(PPOLossInputs(
        logprobs_BT=lp_BT, old_logprobs_BT=old_BT[rows, :w], adv_BT=adv_BT[rows, :w], mask_BT=mask_BT,
        values_BT=critic.model(sub), old_values_BT=old_values_BT[rows, :w],
        returns_BT=returns_BT[rows, :w]), algo)
    run.policy.optimizer.zero_grad(set_to_none=True)
    critic.optimizer.zero_grad(set_to_none=True)
    acc.backward(loss)
    if recipe.train.max_grad_norm > 0:
        acc.clip_grad_norm_(run.policy.model.parameters(), recipe.train.max_grad_norm)
        acc.clip_grad_norm_(critic.model.parameters(), recipe.train.max_grad_norm)
    run.policy.optimizer.step()
    critic.optimizer.step()
    return metrics
