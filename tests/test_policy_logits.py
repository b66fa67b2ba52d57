"""Scoring computes the LM head only where a loss can be: from the first completion column on
(``logits_to_keep``), with the same logprobs as the full computation."""

from __future__ import annotations

import pytest
import torch

from runner.algorithms.logprobs import token_logprobs
from runner.packers.base import RLPolicyInput, collate
from runner.train.policy import batch_logprobs, first_loss_column, forward_logits


@pytest.fixture(scope="module")
def model():
    from runner.models import load_causal_lm

    return load_causal_lm("builtin:tiny-arith")


def _inputs() -> list[RLPolicyInput]:
    shapes = [(12, 4), (9, 3), (15, 2)]  # (length, completion tokens)
    return [RLPolicyInput(tuple(range(3, 3 + n)), (0,) * (n - k) + (1,) * k, n - k)
            for n, k in shapes]


@pytest.mark.parametrize("packed", [False, True])
def test_logprobs_equal_the_full_computation(model, packed):
    batch = collate(_inputs(), 0, packed=packed)
    lp_BT, mask_BT = batch_logprobs(model, batch, 0.7)
    full_BT = token_logprobs(forward_logits(model, batch) / 0.7, batch.input_ids_BT[:, 1:])
    assert lp_BT.shape == full_BT.shape
    assert torch.allclose(lp_BT[mask_BT], full_BT[mask_BT], rtol=0, atol=1e-6)
    assert (lp_BT[:, :first_loss_column(batch)] == 0).all()


def test_the_lm_head_runs_only_from_the_first_completion_column(model):
    batch = collate(_inputs(), 0)
    start = first_loss_column(batch)
    assert start == 9 - 3 - 1  # the shortest prompt (6 tokens) predicts its first answer token at 5
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        batch_logprobs(model, batch)
    finally:
        hook.remove()
    assert seen == [batch.input_ids_BT.shape[1] - start]
