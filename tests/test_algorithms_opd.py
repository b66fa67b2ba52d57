"""On-policy distillation: KL estimates, the loss by hand, and cross-tokenizer alignment."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner.algorithms.opd import (
    OPDLossInputs,
    align_to_student,
    char_spans,
    full_reverse_kl,
    opd_advantages,
    opd_loss,
    sampled_reverse_kl,
)
from runner.recipe.schema import OPDConfig

LN2 = math.log(2)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol
    )


def test_kl_is_zero_when_teacher_equals_student():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g)
    lp = torch.log_softmax(logits, -1)[..., 0]
    assert sampled_reverse_kl(lp, lp).abs().max().item() == 0.0
    close(full_reverse_kl(logits, logits.clone(), torch.ones(2, 3)), torch.zeros(2, 3), atol=1e-7)


def test_full_reverse_kl_by_hand():
    p_s = [[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3], [0.9, 0.05, 0.05]]
    p_t = [[0.25, 0.5, 0.25], [0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]
    student = torch.log(torch.tensor([p_s], dtype=torch.float64)) + 3.0  # logits up to a shift
    teacher = torch.log(torch.tensor([p_t], dtype=torch.float64)) - 1.0
    kl = full_reverse_kl(student, teacher, torch.tensor([[1, 1, 0]]))
    # 0.5 ln2 + 0.25 ln(1/2) = 0.25 ln2;  ln(1/3) - (ln(1/2) + 2 ln(1/4)) / 3 = (5/3) ln2 - ln3
    close(kl, [[0.25 * LN2, 5 / 3 * LN2 - math.log(3), 0.0]])


def test_full_reverse_kl_rejects_different_vocabularies():
    with pytest.raises(ValueError, match=r"student has 5 logits, teacher 7"):
        full_reverse_kl(torch.zeros(1, 2, 5), torch.zeros(1, 2, 7), torch.ones(1, 2))


def test_advantage_is_the_negative_scaled_estimate():
    adv = opd_advantages(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-0.5, -3.0]]), 2.0)
    close(adv, [[1.0, -2.0]])


def _opd_inputs(lp, **logits):
    return OPDLossInputs(
        logprobs_BT=lp,
        old_logprobs_BT=torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64),
        teacher_logprobs_BT=torch.tensor([[-0.5, -3.0, 9.0]], dtype=torch.float64),
        mask_BT=torch.tensor([[True, True, False]]),
        **logits,
    )


def test_opd_loss_value_gradient_and_metrics_by_hand():
    # ratio 1; A = -(old - teacher) = [0.5, -1]; loss = mean(-A) = 0.25; d loss / d lp = -A / 2
    lp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = opd_loss(_opd_inputs(lp), OPDConfig())
    close(loss.detach(), 0.25, atol=1e-12)
    loss.backward()
    close(lp.grad, [[-0.25, 0.5, 0.0]], atol=1e-12)
    assert metrics["reverse_kl"] == pytest.approx(0.25, abs=1e-12)  # mean of [-0.5, 1]
    assert metrics["clip_frac"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0)
    assert "full_kl" not in metrics


def test_opd_full_kl_is_the_exact_reverse_kl_alone():
    lp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64)
    student = torch.log(torch.tensor([[[0.5, 0.25, 0.25]] * 3],
                                     dtype=torch.float64)).requires_grad_()
    teacher = torch.log(torch.tensor([[[0.25, 0.5, 0.25]] * 3], dtype=torch.float64))
    inputs = _opd_inputs(lp, student_logits_BTV=student, teacher_logits_BTV=teacher)
    loss, metrics = opd_loss(inputs, OPDConfig(full_kl=True, kl_coef=2.0))
    # KL = 0.5 ln2 - 0.25 ln2 + 0 = 0.25 ln2 per token; the sampled estimate is not added
    close(loss.detach(), 2 * 0.25 * LN2, atol=1e-12)
    assert metrics["full_kl"] == pytest.approx(0.25 * LN2, abs=1e-7)
    loss.backward()
    # d KL / d logits_s = p_s (log p_s - log p_t - KL); x kl_coef 2 / 2 masked tokens
    expected = [0.5 * 0.75 * LN2, 0.25 * -1.25 * LN2, 0.25 * -0.25 * LN2]
    close(student.grad[0, :2], [expected, expected], atol=1e-12)
    close(student.grad[0, 2], [0.0, 0.0, 0.0], atol=1e-12)
    with pytest.raises(ValueError, match="full_kl"):
        opd_loss(_opd_inputs(lp), OPDConfig(full_kl=True))


# --- cross-tokenizer alignment ---


def test_char_spans():
    assert char_spans(["12", "3", "+4"]) == [(0, 2), (2, 3), (3, 5)]
    assert char_spans(["a", "", "bc"]) == [(0, 1), (1, 1), (1, 3)]
    assert char_spans([]) == []


def test_alignment_hand_example():
    # text "123+4"; student ["12", "3", "+4"], teacher ["1", "23", "+", "4"]
    # teacher last characters 0, 2, 3, 4 fall in student tokens 0, 1, 2, 2
    student = char_spans(["12", "3", "+4"])
    teacher = char_spans(["1", "23", "+", "4"])
    out = align_to_student(student, teacher, [-0.5, -1.25, -0.125, -2.0])
    assert out == [-0.5, -1.25, -2.125]


def test_alignment_zero_width_gaps_and_ends():
    student = [(1, 3), (4, 6)]  # characters 0 and 3 belong to no student token
    teacher = [(0, 1), (2, 4), (3, 3), (4, 6), (6, 6), (9, 10)]
    # (0,1) ends at 0: before the first student -> 0;  (2,4) ends at 3: gap -> following, 1
    # (3,3) zero-width at 3 -> following, 1;  (4,6) -> 1;  (6,6) and (9,10) past the end -> last
    out = align_to_student(student, teacher, [-1.0, -2.0, -4.0, -8.0, -16.0, -32.0])
    assert out == [-1.0, -62.0]


def test_alignment_rejects_bad_inputs():
    with pytest.raises(ValueError, match="2 teacher spans but 1"):
        align_to_student([(0, 1)], [(0, 1), (1, 2)], [0.0])
    with pytest.raises(ValueError, match="span 1"):
        align_to_student([(0, 2), (1, 3)], [(0, 1)], [0.0])
    with pytest.raises(ValueError, match="no student tokens"):
        align_to_student([], [(0, 1)], [0.0])
    assert align_to_student([], [], []) == []


def _partition(draw, n):
    cuts = draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else set()
    bounds = [0, *sorted(cuts), n]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@st.composite
def aligned_case(draw):
    n = draw(st.integers(1, 30))
    student, teacher = _partition(draw, n), _partition(draw, n)
    # multiples of 1/16: every partial sum is exact in float64, so sums compare with ==
    logprobs = [
        k / 16
        for k in draw(st.lists(st.integers(-800, 0), min_size=len(teacher), max_size=len(teacher)))
    ]
    return student, teacher, logprobs


@settings(max_examples=40, deadline=None)
@given(aligned_case())
def test_alignment_preserves_the_total_and_follows_last_characters(case):
    student, teacher, logprobs = case
    out = align_to_student(student, teacher, logprobs)
    assert len(out) == len(student)
    assert sum(out) == sum(logprobs)
    expected = [0.0] * len(student)
    for (_, end), lp in zip(teacher, logprobs, strict=True):
        owner = next(i for i, (s, e) in enumerate(student) if s <= end - 1 < e)
        expected[owner] += lp
    assert out == expected
