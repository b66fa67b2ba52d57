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

from runner.algorithms.grpo import engine_is_weights
from runner.algorithms.masked import masked_sum
from runner.algorithms.ppo import PPOLossInputs, gae, kl_penalized_rewards, ppo_loss
from runner.packers.base import PolicyBatch
from runner.recipe.schema import PPOConfig
from runner.rewards import build_rewards
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
from runner.train.loop import run_loop
from runner.train.policy import completion_grid
from runner.train.roles import Frozen, Trainable, disable_dropout, prepare_trainable
from runner.train.rollouts import evaluate, item_ids_metric, sample, score

CRITIC = "critic"


class ValueModel(torch.nn.Module):
    """A transformer backbone with a scalar value head: values_BT for every position."""

    def __init__(self, backbone: Any, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        dtype = torch.promote_types(next(backbone.parameters()).dtype, torch.float32)
        self.v_head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.v_head.weight)
        torch.nn.init.zeros_(self.v_head.bias)

    def forward(self, batch: PolicyBatch) -> torch.Tensor:
        """Values on the shifted grid [B, T-1]: the value of the state before token t+1."""
        hidden = self.backbone(input_ids=batch.input_ids_BT, use_cache=False,
                               **batch.model_kwargs()).last_hidden_state
        return self.v_head(hidden[:, :-1].to(self.v_head.weight.dtype)).squeeze(-1)


def critic_backbone(lm: Any) -> Any:
    """The module under the LM head whose hidden states the value head reads: the decoder of a
    text model; for a vision-language model its whole base model (vision tower included: the
    critic sees the images), which ``get_decoder`` would leave out."""
    base = getattr(lm, "model", None)
    if base is not None and getattr(base, "visual", None) is not None:
        return base
    return lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model


def build_critic(run: RunContext) -> Trainable:
    from runner.models import load_causal_lm, resolve_model_path, text_hidden_size

    algo = run.recipe.algo
    assert isinstance(algo, PPOConfig)
    path = resolve_model_path(algo.critic_path) if algo.critic_path else run.model_path
    lm = load_causal_lm(path, dtype=run.recipe.model.dtype,
                        trust_remote_code=run.recipe.model.trust_remote_code)
    if run.recipe.train.disable_dropout:
        disable_dropout(lm)
    critic = ValueModel(critic_backbone(lm), text_hidden_size(lm.config))
    if run.ckpt is not None:
        critic.load_state_dict(run.ckpt.extra_state(CRITIC))
    saved = run.ckpt.state.extra.get(CRITIC, {}) if run.ckpt else {}
    return prepare_trainable(run.accelerator, critic, run.recipe, lr=algo.critic_lr or None,
                             ckpt_optimizer=run.ckpt.extra_optimizer_state(CRITIC) if run.ckpt else None,
                             ckpt_scheduler=saved.get("scheduler"))


def run(run: RunContext) -> dict[str, Any]:
    algo = run.recipe.algo
    assert isinstance(algo, PPOConfig)
    rewards = build_rewards(run.recipe.reward)
    # kl_coef = 0: the penalty is 0 whatever the reference says, so none is built or run.
    reference = (run.frozen("reference", run.model_path, run.policy.pad_free)
                 if algo.kl_coef > 0 else None)
    critic = build_critic(run)
    return run_loop(run, lambda step: _one_step(run, algo, rewards, reference, critic, step),
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


def _one_step(run: RunContext, algo: PPOConfig, rewards: Any, reference: Frozen | None,
              critic: Trainable,
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
    T = recipe.rollout.temperature
    with torch.no_grad():
        old_BT, mask_BT = run.policy.logprobs(batch, T)
        engine_BT = completion_grid(inputs, [c.logprobs for c in traj.completions],
                                    old_BT.shape[1]).to(device)
        # The policy's logprobs before the update against the engine's of the same tokens.
        gap = float(((engine_BT - old_BT).abs() * mask_BT).max()) if mask_BT.any() else 0.0
        is_BT = (engine_is_weights(old_BT, engine_BT, algo.engine_is_cap)
                 if algo.engine_is_correction else None)
        ref_BT = reference.logprobs(batch, T)[0] if reference is not None else old_BT
        old_values_BT = critic(batch) * mask_BT
        # GAE runs over completions laid from column 0; the results go back to the batch grid.
        starts = _completion_starts(mask_BT)
        old_c, ref_c, values_c, mask_c = [_left_align(x, starts) for x in
                                          (old_BT, ref_BT, old_values_BT, mask_BT.float())]
        rewards_c = kl_penalized_rewards(torch.tensor(traj.rewards, device=device), old_c, ref_c,
                                         mask_c.bool(), algo.kl_coef)
        adv_c, returns_c = gae(rewards_c, values_c, mask_c.bool(), algo.gamma, algo.lam)
        if algo.whiten_advantages:
            adv_c = global_whiten(run.comm, adv_c, mask_c.bool())
        adv_BT = _restore(adv_c, starts, old_BT.shape[1])
        returns_BT = _restore(returns_c, starts, old_BT.shape[1])
    layout = Layout(run.rank.rank, run.rank.world_size, algo.prompts_per_step, algo.samples_per_prompt)
    weights = gather_rows(run.comm, layout, [float(t) for t in mask_BT.sum(-1).tolist()])

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        sub = select_rows(batch, idx)
        lp_BT, sub_mask_BT = run.policy.logprobs(sub, T)
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
            "kl": kl_sum / max(1.0, n_tok), "rollout/logprob_gap": max(run.comm.gather(gap)), "lr": run.policy.scheduler.get_last_lr()[0], **reduce_history(run.comm, history), **item_ids_metric(traj),
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
