"""GRPO runs a separate no-grad scoring forward only for the rows its first optimizer step does
not train on: that step runs the weights that sampled the data, so its own forward (detached)
gives those rows' behaviour logprobs."""

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
