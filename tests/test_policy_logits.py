"""Scoring computes the LM head only where a loss can be: from the first completion column on
(``logits_to_keep``), with the same logprobs as the full computation."""

from __future__ import annotations

import pytest
import torch

from runner.algorithms.logprobs import token_logprobs
from runner.packers.base import RLPolicyInput, collate
from runner.train.roles.policy import batch_logprobs, first_loss_column, forward_logits


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


def _ragged_inputs() -> list[RLPolicyInput]:
    shapes = [(14, 5), (6, 2), (9, 4), (5, 1), (12, 3), (7, 7)]  # (length, completion tokens)
    return [RLPolicyInput(tuple(3 + (7 * i + j) % 50 for j in range(n)), (0,) * (n - k) + (1,) * k,
                          n - k) for i, (n, k) in enumerate(shapes)]


def test_padding_free_rows_hold_every_sequence_once_with_restarting_positions():
    from runner.train.roles.packing import pack

    inputs = _ragged_inputs()
    batch = collate(inputs, 0)
    p = pack(batch, row_tokens=0)  # rows as long as the longest sequence
    R, C = p.rows.input_ids_BT.shape
    assert C == 14 and R == 4  # 53 tokens in rows of 14: 14 | 12 | 9+5 | 7+6 -> 4 rows, not 6
    assert p.padded_tokens == R * C - 53 == 3
    for b, ((r, o), x) in enumerate(zip(p.where, inputs, strict=True)):
        n = len(x.input_ids)
        assert p.rows.input_ids_BT[r, o:o + n].tolist() == list(x.input_ids)
        assert p.rows.position_ids_BT[r, o:o + n].tolist() == list(range(n))
        assert p.rows.seq_ids_BT[r, o:o + n].tolist() == [b] * n
    from runner.train.roles.packing import packed_logprobs

    assert (p.positions, batch.input_ids_BT.numel()) == (56, 84)  # fewer positions: packed
    same = collate([RLPolicyInput((5, 6, 7, 8), (0, 0, 1, 1), 2)] * 3, 0)
    assert pack(same).positions >= same.input_ids_BT.numel()  # rows would only add positions
    assert packed_logprobs(None, same, 1.0) is None  # the caller runs it padded
    wide = pack(batch, row_tokens=32)
    assert wide.rows.input_ids_BT.shape == (2, 32)  # 14+12+6 | 9+7+5
    assert wide.padded_tokens == 64 - 53
    # rows as long as the fullest: 14+12+9 | 7+6+5 in rows of at most 36
    assert pack(batch, row_tokens=36).rows.input_ids_BT.shape == (2, 35)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_padding_free_logprobs_and_gradients_equal_padded_ones(dtype, monkeypatch):
    import runner.train.roles.packing as packing
    from runner.models import load_causal_lm

    monkeypatch.setattr(packing, "ROW_TOKENS", 14)  # rows of 14: 56 positions packed, 84 padded

    model = load_causal_lm("builtin:tiny-arith", dtype=str(dtype).removeprefix("torch."))
    batch = collate(_ragged_inputs(), 0)
    padded, mask = batch_logprobs(model, batch, 0.8)
    (g_padded,) = torch.autograd.grad((padded * mask).sum(), model.model.embed_tokens.weight)
    free, mask_free = batch_logprobs(model, batch, 0.8, pad_free=True)
    (g_free,) = torch.autograd.grad((free * mask_free).sum(), model.model.embed_tokens.weight)
    assert torch.equal(mask, mask_free)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(free[mask], padded[mask], rtol=0, atol=tol)
    assert (free[~mask] == 0).all()
    # Gradients: sums over every position, so fp32 rounding shows element-wise; the norm of
    # the difference is what is compared (fp64 shows the math is the same to 1e-12).
    assert float((g_free - g_padded).norm() / g_padded.norm()) < tol


def _grouped_inputs() -> list[RLPolicyInput]:
    """Three prompts (7, 4 and 9 tokens) with 3, 2 and 1 completions of 1-6 tokens, interleaved
    as a minibatch draws them, and one sequence with no loss token."""
    prompts = [tuple(3 + (5 * j) % 40 for j in range(7)), (9, 8, 7, 6), tuple(range(20, 29))]
    rows = [(0, 3), (1, 2), (0, 6), (2, 4), (1, 1), (0, 2)]  # (prompt, completion tokens)
    out = [RLPolicyInput(prompts[g] + tuple(30 + (3 * i + j) % 17 for j in range(k)),
                         (0,) * len(prompts[g]) + (1,) * k, len(prompts[g]))
           for i, (g, k) in enumerate(rows)]
    return [*out, RLPolicyInput((4, 5, 6), (0, 0, 0), 3)]


def test_shared_prompts_are_laid_out_once_with_each_completion_after_them():
    from runner.train.roles.packing import choose_layout, share_prompts

    inputs = _grouped_inputs()
    batch = collate(inputs, 0)
    p = share_prompts(batch)
    R, C = p.rows.input_ids_BT.shape
    # 7 + (3 + 6 + 2) | 4 + (2 + 1) | 9 + 4 in one row: 38 positions, none of them padding,
    # against 7 x 13 = 91 padded and 53 packed
    assert (R, C) == (1, 38) and p.filled == 38 and p.padded_tokens == 0
    flat_ids = p.rows.input_ids_BT.reshape(-1)
    flat_pos = p.rows.position_ids_BT.reshape(-1)
    allowed = p.attention[0, 0]
    for b, x in enumerate(inputs[:-1]):
        n = len(x.input_ids)
        where = p.place_BT[b, :n]
        assert flat_ids[where].tolist() == list(x.input_ids)
        assert flat_pos[where].tolist() == list(range(n))  # positions continue the prompt's
        # each token attends to exactly the tokens of its own sequence up to itself
        for t in range(n):
            seen = allowed[where[t]].nonzero().flatten().tolist()
            assert seen == sorted(where[:t + 1].tolist())
    assert (p.place_BT[len(inputs) - 1] == -1).all()  # no loss token: not computed
    # the prompts of rows 0, 2, 5 (and 1, 4) are the same positions
    assert torch.equal(p.place_BT[0, :7], p.place_BT[2, :7])
    assert torch.equal(p.place_BT[1, :4], p.place_BT[4, :4])
    assert choose_layout(batch, mask_kind="bool") is not None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shared_prompt_logprobs_and_gradients_equal_padded_ones(attn, dtype):
    from runner.models import load_causal_lm
    from runner.train.roles.packing import choose_layout, pack

    model = load_causal_lm("builtin:tiny-arith", dtype=str(dtype).removeprefix("torch."))
    model.set_attn_implementation(attn)
    batch = collate(_grouped_inputs(), 0)
    layout = choose_layout(batch, mask_kind="bool")
    assert layout is not None and layout.attention is not None  # shared prompts were chosen
    assert layout.positions < pack(batch).positions
    padded, mask = batch_logprobs(model, batch, 0.8)
    (g_padded,) = torch.autograd.grad((padded * mask).sum(), model.model.embed_tokens.weight)
    free, mask_free = batch_logprobs(model, batch, 0.8, pad_free=True)
    (g_free,) = torch.autograd.grad((free * mask_free).sum(), model.model.embed_tokens.weight)
    assert torch.equal(mask, mask_free)
    # fp64 through SDPA shows the layout computes the same function to 1e-12. Eager attention
    # takes its softmax in float32 whatever the model's dtype, and every model's RMSNorm computes
    # in float32: the prompt's gradient, summed over its completions in another order, and eager's
    # softmax over rows with more masked entries round differently, at float32's level.
    tol = 1e-12 if (dtype, attn) == (torch.float64, "sdpa") else 1e-5
    torch.testing.assert_close(free[mask], padded[mask], rtol=0, atol=tol)
    assert (free[~mask] == 0).all()
    assert (float((g_free - g_padded).norm() / g_padded.norm())
            < (1e-5 if dtype == torch.float32 else 1e-6))


def test_flash_attention_models_fall_back_to_block_diagonal_packing():
    from runner.train.roles.packing import attention_mask_kind, choose_layout

    class Config:
        _attn_implementation = "flash_attention_2"

    class Model:
        config = Config()

    assert attention_mask_kind(Model()) is None
    layout = choose_layout(collate(_grouped_inputs(), 0), mask_kind=None)
    assert layout is None or layout.attention is None


def test_first_fit_decreasing_places_each_item_in_the_first_row_with_room():
    """The row search that skips full rows gives plain first-fit decreasing's placement (every
    row tried from the first), on random sizes, capacities and ties."""
    import random

    from runner.train.roles.packing import _first_fit

    def plain(sizes, capacity):
        fill, where = [], [None] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
            row = next((r for r, used in enumerate(fill) if used + sizes[i] <= capacity),
                       len(fill))
            fill += [0] * (row == len(fill))
            where[i] = (row, fill[row])
            fill[row] += sizes[i]
        return where, fill

    rng = random.Random(5)
    for _ in range(300):
        sizes = [rng.randint(1, 40) for _ in range(rng.randint(0, 60))]
        capacity = max(sizes, default=1) + rng.choice([0, 1, 7, 50, 200])
        assert _first_fit(sizes, capacity) == plain(sizes, capacity)
    assert _first_fit([5, 3, 3, 2], 8) == ([(0, 0), (0, 5), (1, 0), (1, 3)], [8, 5])


def test_a_batch_chooses_its_layout_once_for_every_forward_of_it(model, monkeypatch):
    """The reference's and the policy's forwards of one batch (DPO) share the layout chosen for
    the first; a batch made from it (moved, selected) chooses its own."""
    from runner.train.roles import packing

    chosen = []
    real = packing.choose_layout

    def counting(batch, *args, **kwargs):
        chosen.append(batch)
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(packing, "choose_layout", counting)
    batch = collate(_grouped_inputs(), 0)
    with torch.no_grad():
        first, mask = batch_logprobs(model, batch, 0.8, pad_free=True)
    second, _ = batch_logprobs(model, batch, 0.8, pad_free=True)
    assert chosen == [batch] and batch.layouts  # chosen once, kept on the batch
    assert second.requires_grad and torch.equal(first, second.detach())
    moved = batch.to("cpu")
    assert moved is not batch and not moved.layouts
    batch_logprobs(model, moved, 0.8, pad_free=True)
    assert len(chosen) == 2 and chosen[1] is moved
