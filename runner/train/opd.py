"""The on-policy distillation loop (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025).

The student samples completions; the teacher scores the student's tokens; the per-token reverse
KL estimate ``logp_student - logp_teacher`` of each sampled token, negated, is its advantage in
a clipped policy-gradient step. ``same_tokenizer`` mode scores the student's ids directly.
``cross_token_multimodal`` mode lets the teacher have its own tokenizer: a student-codec packer
(built from the student's factory) decodes the completion, the teacher packer re-encodes the
prompt and the completion text, and the teacher's token logprobs are summed onto the student
tokens whose character spans hold them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runner.algorithms.logprobs import token_logprobs
from runner.algorithms.opd import (
    OPDLossInputs,
    align_to_student,
    full_reverse_kl,
    opd_loss,
    sampled_reverse_kl,
)
from runner.models.vocab import check_same_vocab
from runner.packers.base import RLPolicyInput, collate
from runner.recipe.schema import OPDConfig
from runner.rewards import build_rewards
from runner.rollout.base import Completion
from runner.train.assemble import RunContext
from runner.train.batches import (
    Layout,
    Minibatch,
    rank_mean,
    reduce_history,
    select_rows,
    train_minibatch,
)
from runner.train.loop import run_loop
from runner.train.policy import completion_grid
from runner.train.rollouts import (
    Trajectory,
    evaluate,
    item_ids_metric,
    position_seeds,
    roll_out,
    sample,
    sampling,
    score,
)


class Teacher:
    """The frozen teacher with what it needs to score student completions."""

    def __init__(self, run: RunContext, algo: OPDConfig) -> None:
        from runner.models import read_model_type, resolve_model_path
        from runner.packers import build_packer

        self.path: Path = resolve_model_path(algo.teacher_path, key="algo.teacher_path")
        self.frozen = run.frozen("teacher", self.path,
                                 run.policy.pad_free and algo.mode == "same_tokenizer")
        self.mode = algo.mode
        self.device = run.accelerator.device
        self.pad_token_id = run.policy_packer.pad_token_id
        if algo.mode == "same_tokenizer":
            check_same_vocab(run.model_path, self.path,
                             trust_remote_code=run.recipe.model.trust_remote_code)
            self.student_codec = self.packer = None
        else:  # built only in this mode
            self.student_codec = run.build_packer()
            self.packer = build_packer(self.path, read_model_type(self.path),
                                       run.recipe.data_packer.teacher_model_factory,
                                       key="data_packer.teacher_model_factory",
                                       trust_remote_code=run.recipe.model.trust_remote_code,
                                       dtype=run.recipe.model.dtype)

    @torch.no_grad()
    def logprobs(self, traj: Trajectory, inputs: Sequence[RLPolicyInput], width: int,
                 temperature: float) -> torch.Tensor:
        """Teacher logprobs of each student completion token, on the student's grid [B, width]."""
        if self.mode == "same_tokenizer":
            batch = collate(inputs, self.pad_token_id).to(self.device)
            return self.frozen.logprobs(batch, temperature)[0][:, :width]
        values = [self._aligned(item, c, temperature)
                  for item, c in zip(traj.items, traj.completions, strict=True)]
        return completion_grid(inputs, values, width).to(self.device)

    def _aligned(self, item: Any, completion: Any, temperature: float) -> list[float]:
        """Teacher logprobs (at the sampling temperature, like the student's) of one completion's
        text under the teacher's tokenizer, summed onto the student's tokens."""
        codec, packer = self.student_codec, self.packer
        ids = list(completion.token_ids)
        prefix = [len(codec.decode(ids[:k])) for k in range(len(ids) + 1)]
        student_spans = list(zip(prefix, prefix[1:], strict=False))
        text = codec.decode(ids)
        teacher_ids, teacher_spans = packer.encode_with_offsets(text)
        if completion.finish_reason == "stop":
            teacher_ids.append(packer.eos_token_id)
            teacher_spans.append((len(text), len(text)))
        if not teacher_ids:
            return [0.0] * len(ids)
        # The teacher's packer builds its own input from the item (a multimodal teacher's
        # includes the item's images), followed by the completion in the teacher's tokens.
        x = packer.get_policy_input(item, Completion(tuple(teacher_ids), text, (), "length"))
        lp_BT, mask_BT = self.frozen.logprobs(packer.collate([x]).to(self.device), temperature)
        return align_to_student(student_spans, teacher_spans, lp_BT[mask_BT].tolist())


def run(run: RunContext) -> dict[str, Any]:
    algo = run.recipe.algo
    assert isinstance(algo, OPDConfig)
    teacher = Teacher(run, algo)
    rewards = build_rewards(run.recipe.reward)

    def held_out() -> dict[str, float]:
        return evaluate(run, rewards) | held_out_reverse_kl(run, teacher)

    return run_loop(run, lambda step: _one_step(run, algo, teacher, rewards, step),
                    held_out if run.has_held_out else None)


# The held-out reverse KL samples with this seed at every evaluation, so evaluations differ only
# by the student's weights.
HELD_OUT_SEED = 7_919


@torch.no_grad()
def held_out_reverse_kl(run: RunContext, teacher: Teacher) -> dict[str, float]:
    """The student's reverse KL to the teacher on the held-out prompts: one completion each,
    sampled like the training rollouts, per-token ``logp_student - logp_teacher`` averaged over
    every completion token of every rank (the estimate the training metric ``reverse_kl``
    reports). With one vocabulary also ``eval/reverse_kl_exact``: the full-vocabulary
    KL(student || teacher) at the same positions, without the sampling noise of the estimate."""
    total = count = exact = 0.0
    if run.val_items:
        seeds = position_seeds(run, HELD_OUT_SEED, 0, len(run.val_items))
        traj = roll_out(run.rollout, run.val_items, sampling(run.recipe.rollout, 1, 0), seeds)
        T = run.recipe.rollout.temperature
        inputs = traj.policy_inputs(run.policy_packer)
        batch = run.policy_packer.collate(inputs).to(run.accelerator.device)
        mask_BT = batch.loss_mask_BT[:, 1:].bool()
        if teacher.mode == "same_tokenizer":  # one forward each: the logits give both numbers
            labels_BT = batch.input_ids_BT[:, 1:]
            student = run.policy.logits(batch) / T
            teacher_logits = _teacher_logits(teacher, batch, T)
            student_BT = token_logprobs(student, labels_BT)
            teacher_BT = token_logprobs(teacher_logits, labels_BT)
            exact = float(full_reverse_kl(student, teacher_logits[..., :student.shape[-1]],
                                          mask_BT).sum())
        else:
            student_BT = run.policy.logprobs(batch, T)[0]
            teacher_BT = teacher.logprobs(traj, inputs, student_BT.shape[1], T)
        total = float((sampled_reverse_kl(student_BT, teacher_BT) * mask_BT).sum())
        count = float(mask_BT.sum())
    total, count, exact = run.comm.sum([total, count, exact])
    out = {"eval/reverse_kl": total / max(1.0, count)}
    if teacher.mode == "same_tokenizer":
        out["eval/reverse_kl_exact"] = exact / max(1.0, count)
    return out


def _one_step(run: RunContext, algo: OPDConfig, teacher: Teacher, rewards: Any, step: int) -> dict[str, Any]:
    recipe = run.recipe
    T = recipe.rollout.temperature
    t0 = time.perf_counter()
    traj = sample(run, algo.prompts_per_step, algo.samples_per_prompt, step)
    traj = score(traj, rewards, step)
    t1 = time.perf_counter()
    inputs = traj.policy_inputs(run.policy_packer)
    batch = run.policy_packer.collate(inputs).to(run.accelerator.device)
    mask_BT = batch.loss_mask_BT[:, 1:].bool()
    # With the full KL the loss's own teacher forward (its logits) also gives the teacher's
    # logprobs of the sampled tokens: no separate scoring forward.
    teacher_BT = None if algo.full_kl else teacher.logprobs(traj, inputs, mask_BT.shape[1], T)
    # One pass over freshly sampled data: the behaviour logprobs are the first forward's own
    # (detached), so no separate scoring forward is needed.
    old_BT = None
    if algo.ppo_epochs > 1:
        with torch.no_grad():
            old_BT = run.policy.logprobs(batch, T)[0]
    t2 = time.perf_counter()
    layout = Layout(run.rank.rank, run.rank.world_size, algo.prompts_per_step, algo.samples_per_prompt)
    tokens = [float(t) for t in mask_BT.sum(-1).tolist()]
    # One optimizer step per epoch over the whole global batch (token mean).
    whole = Minibatch(list(range(len(tokens))), tokens, run.comm.sum([sum(tokens)])[0])

    def loss_fn(rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        sub = select_rows(batch, rows)
        labels_BT = sub.input_ids_BT[:, 1:]
        if algo.full_kl:  # the full-vocabulary KL needs every logit of the completion positions
            logits = run.policy.logits(sub) / T
            lp_BT = token_logprobs(logits, labels_BT)
            teacher_logits = _teacher_logits(teacher, sub, T)
            teacher_lp_BT = token_logprobs(teacher_logits, labels_BT)  # its whole vocabulary
            teacher_logits = teacher_logits[..., :logits.shape[-1]]
        else:
            lp_BT, logits, teacher_logits = run.policy.logprobs(sub, T)[0], None, None
            teacher_lp_BT = teacher_BT[rows, :lp_BT.shape[1]]
        old = lp_BT.detach() if old_BT is None else old_BT[rows, :lp_BT.shape[1]]
        return opd_loss(OPDLossInputs(
            logprobs_BT=lp_BT, old_logprobs_BT=old, teacher_logprobs_BT=teacher_lp_BT,
            mask_BT=sub.loss_mask_BT[:, 1:].bool(), student_logits_BTV=logits,
            teacher_logits_BTV=teacher_logits), algo)

    history = [train_minibatch([run.policy], whole, loss_fn, recipe.train.grad_accum_steps,
                               layout.world, recipe.train.max_grad_norm)
               for _ in range(algo.ppo_epochs)]
    run.policy.scheduler.step()
    t3 = time.perf_counter()
    run.sync_weights()
    t4 = time.perf_counter()
    reward_sum, n = run.comm.sum([sum(traj.rewards), len(traj.rewards)])
    return {"reward/mean": reward_sum / n, **rank_mean(run.comm, traj.reward_parts),
            **rank_mean(run.comm, run.policy.padding_metrics(batch)),
            **reduce_history(run.comm, history), **item_ids_metric(traj),
            "lr": run.policy.scheduler.get_last_lr()[0],
            "time/rollout": t1 - t0, "time/teacher": t2 - t1, "time/update": t3 - t2,
            "time/sync": t4 - t3, "perf/rollout_tok_s": traj.n_tokens / max(t1 - t0, 1e-9)}


@torch.no_grad()
def _teacher_logits(teacher: Teacher, batch: Any, temperature: float) -> torch.Tensor:
    """Teacher logits over the teacher's whole vocabulary (callers cut a padded one to the
    student's width for the KL)."""
    return teacher.frozen.logits(batch) / temperature
