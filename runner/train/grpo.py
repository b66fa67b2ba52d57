"""The GRPO loop (Shao et al. 2024, DeepSeekMath): sample a group of completions per prompt,
score them, normalise rewards within each group, and take clipped policy-gradient steps.

One step: this rank's prompts from the global cursor -> ``group_size`` completions each ->
rewards -> advantages (from every rank's rewards, so ``scale_rewards = "batch"`` uses the global
batch) -> ``ppo_epochs`` x ``minibatches`` optimizer steps over minibatches of the global batch
-> new weights to the engine -> metrics, eval, checkpoint. Everything random is seeded from
(run seed, step) and each prompt's global position, so a resumed run repeats the uninterrupted
one exactly, and the same global batch trains the same way on any number of ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from runner.algorithms.grpo import GRPOLossInputs, engine_is_weights, group_advantages, grpo_loss
from runner.recipe.schema import GRPOConfig
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
from runner.train.roles import Frozen
from runner.train.rollouts import (
    Trajectory,
    evaluate,
    item_ids_metric,
    sample,
    score,
    shared_prefixes,
)


def run(run: RunContext) -> dict[str, Any]:
    algo = run.recipe.algo
    assert isinstance(algo, GRPOConfig)
    rewards = build_rewards(run.recipe.reward)
    reference = (run.frozen("reference", run.model_path, run.policy.pad_free)
                 if algo.kl_beta > 0 else None)
    return run_loop(run, lambda step: _one_step(run, algo, rewards, reference, step),
                    (lambda: evaluate(run, rewards)) if run.has_held_out else None)


def _one_step(run: RunContext, algo: GRPOConfig, rewards: Any, reference: Frozen | None,
              step: int) -> dict[str, Any]:
    recipe = run.recipe
    t0 = time.perf_counter()
    traj = sample(run, algo.prompts_per_step, algo.group_size, step)
    t1 = time.perf_counter()
    traj = score(traj, rewards, step)
    ignore = shared_prefixes(traj, algo.group_size) if algo.shared_prefix_filter else None
    t2 = time.perf_counter()
    layout = Layout(run.rank.rank, run.rank.world_size, algo.prompts_per_step, algo.group_size)
    rewards_all = gather_rows(run.comm, layout, traj.rewards)
    metrics = _update(run, algo, layout, traj, rewards_all, reference, step, ignore)
    if ignore is not None:
        metrics["prefix_tokens_filtered"] = sum(gather_rows(run.comm, layout, ignore)) / layout.global_rows
    t3 = time.perf_counter()
    run.sync_weights()
    t4 = time.perf_counter()
    if recipe.logging.sample_every and step % recipe.logging.sample_every == 0:
        run.reporter.sample(step, str(traj.items[0].prompt), traj.texts[0], traj.rewards[0])
    r = torch.tensor(rewards_all)
    n_tokens, n_completions = run.comm.sum([traj.n_tokens, len(traj.completions)])
    return {
        "reward/mean": float(r.mean()), "reward/max": float(r.max()),
        **rank_mean(run.comm, traj.reward_parts),
        "completion_len": n_tokens / n_completions, **metrics, **item_ids_metric(traj),
        "time/rollout": t1 - t0, "time/reward": t2 - t1, "time/update": t3 - t2, "time/sync": t4 - t3,
        "perf/rollout_tok_s": traj.n_tokens / max(t1 - t0, 1e-9),
        "perf/train_tok_s": algo.ppo_epochs * traj.n_tokens / max(t3 - t2, 1e-9),
    }


def _update(run: RunContext, algo: GRPOConfig, layout: Layout, traj: Trajectory,
            rewards_all: list[float], reference: Frozen | None, step: int,
            ignore_prefix: list[int] | None) -> dict[str, float]:
    recipe, policy = run.recipe, run.policy
    device = run.accelerator.device
    adv_all = group_advantages(torch.tensor(rewards_all), algo.group_size, algo.scale_rewards)
    adv_B = adv_all[[layout.global_row(i) for i in range(len(traj.completions))]].to(device)
    inputs = traj.policy_inputs(run.policy_packer, ignore_prefix)
    batch = run.policy_packer.collate(inputs).to(device)
    width = batch.input_ids_BT.shape[1] - 1
    temperature = recipe.rollout.temperature
    tokens = [float(t) for t in batch.loss_mask_BT[:, 1:].sum(-1).tolist()]
    weights = gather_rows(run.comm, layout, tokens if algo.loss_agg == "token_mean" else
                          [1.0] * len(tokens))
    epochs = [minibatches(layout, weights, algo.minibatches,
                          step_seed(recipe.run.seed, step, salt=1 + epoch))
              for epoch in range(algo.ppo_epochs)]
    # The first optimizer step trains on freshly sampled data with the weights that sampled it:
    # its rows' behaviour logprobs are that step's own forward (detached). Only the other rows
    # need a separate scoring forward, and none when there is one minibatch.
    first_rows = set(epochs[0][0].rows)
    others = [r for r in range(len(traj.completions)) if r not in first_rows]
    with torch.no_grad():
        engine_BT = completion_grid(inputs, [c.logprobs for c in traj.completions], width).to(device)
        old_BT = engine_BT if algo.old_logprobs == "engine" else None
        if algo.old_logprobs == "policy":
            dtype = torch.promote_types(next(policy.model.parameters()).dtype, torch.float32)
            old_BT = torch.zeros_like(engine_BT, dtype=dtype)
            if algo.minibatches > 1:
                # Every rank runs this forward (DDP's forwards are collective); one that holds
                # no row outside the first minibatch scores its row 0 and keeps nothing.
                rows = torch.tensor(others or [0], device=device)
                scored = policy.logprobs(select_rows(batch, rows), temperature)[0]
                if others:
                    old_BT[rows, :scored.shape[1]] = scored
        ref_BT = reference.logprobs(batch, temperature)[0] if reference is not None else None
    # The first optimizer step's forwards run the weights the engine sampled with: their
    # logprobs of the sampled tokens differ from the engine's only by numerics (a stale engine
    # shows here).
    gaps, first = [torch.zeros(())], [True]
    # (A rank holding no row of the first minibatch only takes part with a zero-weighted row.)
    own_old = algo.old_logprobs == "policy" and bool(first_rows)

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        sub = select_rows(batch, idx)
        lp_BT, mask_BT = policy.logprobs(sub, temperature)
        w = lp_BT.shape[1]
        if first[0]:
            gaps.append(((engine_BT[idx, :w] - lp_BT.detach()).abs() * mask_BT).max())
            if own_old:  # kept for the later epochs
                old_BT[idx, :w] = lp_BT.detach()
        old = lp_BT.detach() if first[0] and own_old else old_BT[idx, :w]
        is_w = (engine_is_weights(old, engine_BT[idx, :w], algo.engine_is_cap)
                if algo.engine_is_correction else None)
        return grpo_loss(GRPOLossInputs(
            logprobs_BT=lp_BT, old_logprobs_BT=old, adv_B=adv_B[idx],
            ref_logprobs_BT=None if ref_BT is None else ref_BT[idx, :w], mask_BT=mask_BT,
            max_tokens=recipe.rollout.max_new_tokens, is_weights_BT=is_w), algo)

    history = []
    for mbs in epochs:
        for mb in mbs:
            history.append(train_minibatch([policy], mb, loss_fn, recipe.train.grad_accum_steps,
                                           layout.world, recipe.train.max_grad_norm))
            first[0] = False
    policy.scheduler.step()
    out = reduce_history(run.comm, history)
    out["lr"] = policy.scheduler.get_last_lr()[0]
    out["adv_abs_mean"] = float(adv_all.abs().mean())
    out.update(rank_mean(run.comm, policy.padding_metrics(batch)))
    out["rollout/logprob_gap"] = max(run.comm.gather(float(torch.stack(gaps).max())))
    return out
