"""Masked reductions: hand-computed values, empty slices give 0 and no NaN gradient."""

import math

import pytest
import torch

from runner.algorithms.masked import masked_mean, masked_sum, masked_whiten


def test_masked_sum_and_mean_by_row_and_total():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert masked_sum(x, mask).item() == 9.0
    assert masked_sum(x, mask, dim=1).tolist() == [3.0, 6.0]
    assert masked_mean(x, mask).item() == 3.0
    assert masked_mean(x, mask, dim=1).tolist() == [1.5, 6.0]
    assert masked_mean(x, mask, dim=0).tolist() == [1.0, 2.0, 6.0]


def test_all_masked_row_is_zero_without_nan_in_value_or_gradient():
    x = torch.tensor([[1.0, 3.0], [float("inf"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    row_mean = masked_mean(x, mask, dim=1)
    assert row_mean.tolist() == [2.0, 0.0]
    row_mean.sum().backward()
    assert x.grad.tolist() == [[0.5, 0.5], [0.0, 0.0]]
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_integer_mask_is_accepted():
    x = torch.tensor([2.0, 4.0, 8.0])
    assert masked_mean(x, torch.tensor([1, 0, 1])).item() == 5.0


def test_masked_whiten_uses_unbiased_variance_of_masked_elements():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0], dtype=torch.bool)
    # mean 2, unbiased var ((-1)^2 + 0 + 1^2) / 2 = 1
    scale = 1 / math.sqrt(1 + 1e-8)
    out = masked_whiten(x, mask)
    torch.testing.assert_close(out, torch.tensor([-scale, 0.0, scale, 0.0]), rtol=0, atol=1e-7)
    kept = masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(
        kept, torch.tensor([2 - scale, 2.0, 2 + scale, 0.0]), rtol=0, atol=1e-6
    )


def test_masked_whiten_needs_two_elements():
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(torch.tensor([1.0, 2.0]), torch.tensor([True, False]))
