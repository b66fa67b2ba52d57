"""No scoring forward that a training forward already gives. GRPO runs a separate no-grad
scoring forward only for the rows its first optimizer step does not train on: that step runs
the weights that sampled the data, so its own forward (detached) gives those rows' behaviour
logprobs. OPD's teacher runs once per trained row."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("minibatches, scored", [(1, 0), (2, 8), (4, 12)])
def test_only_rows_after_the_first_minibatch_are_scored(run_cli, monkeypatch, tmp_path,
                                                        minibatches, scored):
    from runner.train.roles import Trainable

    calls: list[tuple[bool, int]] = []
    logprobs = Trainable.logprobs

    def spy(self, batch, temperature=1.0):
        calls.append((torch.is_grad_enabled(), batch.input_ids_BT.shape[0]))
        return logprobs(self, batch, temperature)

    monkeypatch.setattr(Trainable, "logprobs", spy)
    rc, out, err = run_cli("--plain", "recipes/grpo-arith.toml", f"run.output_dir={tmp_path}",
                           "run.max_steps=1", "data.validation.enabled=false",
                           "algo.prompts_per_step=4", "algo.group_size=4",
                           f"algo.minibatches={minibatches}", "logging.sample_every=0")
    assert rc == 0, out + err
    assert sum(n for grad, n in calls if not grad) == scored  # 16 rows, minus the first minibatch's
    assert sum(n for grad, n in calls if grad) == 16  # every row trains once


@pytest.mark.parametrize("full_kl, accum", [(True, 1), (True, 2), (False, 1)])
def test_opd_runs_one_teacher_forward_per_row(run_cli, monkeypatch, tmp_path, full_kl, accum):
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
    rc, out, err = run_cli("--plain", "recipes/opd-arith.toml", f"run.output_dir={tmp_path}",
                           "run.max_steps=1", "data.validation.enabled=false",
                           "algo.prompts_per_step=4", f"algo.full_kl={str(full_kl).lower()}",
                           f"train.grad_accum_steps={accum}", "logging.sample_every=0")
    assert rc == 0, out + err
    assert sum(rows) == 8 and len(rows) == (accum if full_kl else 1)  # 4 prompts x 2 samples
