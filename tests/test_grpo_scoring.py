"""No scoring forward that a training forward already gives. GRPO runs a separate no-grad
scoring forward only for the rows its first optimizer step does not train on: that step runs
the weights that sampled the data, so its own forward (detached) gives those rows' behaviour
logprobs. OPD's teacher runs once per trained row. Each test runs one step's score and consume
directly (``tests/tiny_run.py``) and counts the rows each forward scored."""

from __future__ import annotations

import pytest
import torch

from runner.train.loops import grpo, opd
from tests.tiny_run import tiny_run


@pytest.mark.parametrize("minibatches, scored", [(1, 0), (2, 8), (4, 12)])
def test_only_rows_after_the_first_minibatch_are_scored(monkeypatch, tmp_path, minibatches,
                                                        scored):
    from runner.train.roles import Trainable

    calls: list[tuple[bool, int]] = []
    logprobs = Trainable.logprobs

    def spy(self, batch, temperature=1.0):
        calls.append((torch.is_grad_enabled(), batch.input_ids_BT.shape[0]))
        return logprobs(self, batch, temperature)

    monkeypatch.setattr(Trainable, "logprobs", spy)
    with tiny_run("grpo-arith", tmp_path, "algo.prompts_per_step=4", "algo.group_size=4",
                  f"algo.minibatches={minibatches}") as run:
        algo = run.svc.recipe.algo
        traj = grpo.produce(run, algo, 1)
        grpo.consume(run, algo, grpo.score(run, algo, run.roles.rewards, traj, 1))
    assert sum(n for grad, n in calls if not grad) == scored  # 16 rows, minus the first minibatch's
    assert sum(n for grad, n in calls if grad) == 16  # every row trains once


@pytest.mark.parametrize("full_kl, accum", [(True, 1), (True, 2), (False, 1)])
def test_opd_runs_one_teacher_forward_per_row(monkeypatch, tmp_path, full_kl, accum):
    """OPD's teacher scores each trained row once: with the full KL the loss's teacher logits also
    give the sampled tokens' teacher logprobs; without it one scoring forward does."""
    from runner.train.roles import Frozen

    rows: list[int] = []
    for name in ("logprobs", "logits"):
        original = getattr(Frozen, name)

        def spy(self, batch, *args, _original=original, **kwargs):
            rows.append(batch.input_ids_BT.shape[0])
            return _original(self, batch, *args, **kwargs)

        monkeypatch.setattr(Frozen, name, spy)
    with tiny_run("opd-arith", tmp_path, "algo.prompts_per_step=4",
                  f"algo.full_kl={str(full_kl).lower()}", f"train.grad_accum_steps={accum}") as run:
        algo, teacher = run.svc.recipe.algo, run.roles.teacher
        traj = opd.produce(run, algo, 1)
        opd.consume(run, algo, teacher, opd.score(run, algo, teacher, run.roles.rewards, traj, 1))
    assert sum(rows) == 8 and len(rows) == (accum if full_kl else 1)  # 4 prompts x 2 samples
