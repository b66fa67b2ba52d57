"""On-policy distillation: the student samples, the teacher scores, the reverse KL is the cost.

Generalized knowledge distillation on the student's own samples (Agarwal et al. 2024,
"On-Policy Distillation of Language Models", arXiv:2306.13649) in the per-token-advantage form
of Thinking Machines Lab's "On-Policy Distillation" (2025 blog post): the advantage of a sampled
token is -(log pi_student - log pi_teacher), optimised with the clipped policy-gradient loss.
When the teacher has another tokenizer, its per-token logprobs are moved onto the student's
tokens by character spans (``align_to_student``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from runner.algorithms.grpo import clipped_token_loss
from runner.algorithms.masked import at_least_float32, masked_mean, metric
from runner.recipe.schema import OPDConfig

Span = tuple[int, int]


def sampled_reverse_kl(student_logprobs_BT: Tensor, teacher_logprobs_BT: Tensor) -> Tensor:
    """log pi_s(y_t) - log pi_t(y_t) for the sampled tokens: [B, T] -> [B, T].

    A one-sample (k1) estimate of KL(pi_s || pi_t) per token when y ~ pi_s.
    """
    return student_logprobs_BT - teacher_logprobs_BT


def opd_advantages(
    student_logprobs_BT: Tensor, teacher_logprobs_BT: Tensor, kl_coef: float
) -> Tensor:
    """A_t = -kl_coef (log pi_s(y_t) - log pi_t(y_t)), detached: [B, T] -> [B, T]."""
    return -kl_coef * sampled_reverse_kl(student_logprobs_BT, teacher_logprobs_BT).detach()


def full_reverse_kl(
    student_logits_BTV: Tensor, teacher_logits_BTV: Tensor, mask_BT: Tensor
) -> Tensor:
    """sum_v p_s(v) (log p_s(v) - log p_t(v)) per position, >= float32: [B, T, V] x2 -> [B, T].

    Exact KL(pi_s || pi_t) over a shared vocabulary; 0 outside the mask; the teacher is
    detached. Raises ValueError when the vocabulary sizes differ.
    """
    v_s, v_t = student_logits_BTV.shape[-1], teacher_logits_BTV.shape[-1]
    if v_s != v_t:
        raise ValueError(
            f"full reverse KL needs one vocabulary (student has {v_s} logits, teacher {v_t}); "
            "set algo.full_kl = false for teachers with another vocabulary."
        )
    logp_s_BTV = torch.log_softmax(at_least_float32(student_logits_BTV), dim=-1)
    logp_t_BTV = torch.log_softmax(at_least_float32(teacher_logits_BTV.detach()), dim=-1)
    kl_BT = (logp_s_BTV.exp() * (logp_s_BTV - logp_t_BTV)).sum(dim=-1)
    return torch.where(mask_BT.to(torch.bool), kl_BT, torch.zeros_like(kl_BT))


@attrs.frozen(kw_only=True, eq=False)
class OPDLossInputs:
    """One micro-batch for ``opd_loss``; [B, T] logprobs of the sampled student tokens.

    ``old_logprobs_BT`` are the student's logprobs at sampling time (the advantage uses them);
    ``teacher_logprobs_BT`` are aligned to the student's tokens. The logits ([B, T, V]) are
    needed only with cfg.full_kl.
    """

    logprobs_BT: Tensor
    old_logprobs_BT: Tensor
    teacher_logprobs_BT: Tensor
    mask_BT: Tensor
    student_logits_BTV: Tensor | None = None
    teacher_logits_BTV: Tensor | None = None


def opd_loss(inputs: OPDLossInputs, cfg: OPDConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy gradient on A_t = -kl_coef (log pi_s_old - log pi_t), token mean; with
    cfg.full_kl the exact reverse KL instead.

    loss = token_mean(-min(r A, clip(r, 1 - eps, 1 + eps) A)), eps = cfg.clip_eps: the
    single-sample estimate of the per-token reverse-KL gradient (Agarwal et al. 2024, on-policy
    distillation). With cfg.full_kl: loss = kl_coef token_mean(KL(pi_s || pi_t)) summed over
    the whole shared vocabulary at each sampled position, the same per-token gradient without
    its sampling noise (the objective of generalized KD with the reverse direction). Metrics
    (detached 0-d tensors): loss, reverse_kl (masked mean of the sampled estimate at sampling time),
    clip_frac, ratio_mean, and full_kl when used.
    """
    x = inputs
    adv_BT = opd_advantages(x.old_logprobs_BT, x.teacher_logprobs_BT, cfg.kl_coef)
    pg_BT, clipped_BT = clipped_token_loss(
        x.logprobs_BT, x.old_logprobs_BT, adv_BT, cfg.clip_eps, cfg.clip_eps
    )
    loss = masked_mean(pg_BT, x.mask_BT)
    full_kl = None
    if cfg.full_kl:
        if x.student_logits_BTV is None or x.teacher_logits_BTV is None:
            raise ValueError(
                "algo.full_kl = true needs student and teacher logits in the loss inputs; "
                "pass them or set algo.full_kl = false."
            )
        full_kl = masked_mean(
            full_reverse_kl(x.student_logits_BTV, x.teacher_logits_BTV, x.mask_BT), x.mask_BT
        )
        loss = cfg.kl_coef * full_kl
    with torch.no_grad():
        m = x.mask_BT
        metrics = {
            "loss": metric(loss),
            "reverse_kl": metric(
                masked_mean(sampled_reverse_kl(x.old_logprobs_BT, x.teacher_logprobs_BT), m)
            ),
            "clip_frac": metric(masked_mean(clipped_BT.float(), m)),
            "ratio_mean": metric(masked_mean(torch.exp(x.logprobs_BT - x.old_logprobs_BT), m)),
        }
        if full_kl is not None:
            metrics["full_kl"] = metric(full_kl)
    return loss, metrics


def char_spans(token_strings: Sequence[str]) -> list[Span]:
    """[start, end) character offsets of consecutive decoded tokens in their concatenation.

    Valid only when "".join(token_strings) is the text (decode each token on its own and check;
    byte-level tokens that split a UTF-8 character do not satisfy this).

    >>> char_spans(["12", "3", "+4"])
    [(0, 2), (2, 3), (3, 5)]
    """
    spans: list[Span] = []
    pos = 0
    for piece in token_strings:
        spans.append((pos, pos + len(piece)))
        pos += len(piece)
    return spans


def _check_student_spans(spans: Sequence[Span]) -> None:
    prev_end = 0
    for i, (start, end) in enumerate(spans):
        if start > end or start < prev_end:
            raise ValueError(
                f"student spans must be ordered, non-overlapping [start, end) pairs; "
                f"span {i} is {(start, end)} after one ending at {prev_end}."
            )
        prev_end = end


def align_to_student(
    student_spans: Sequence[Span],
    teacher_spans: Sequence[Span],
    teacher_logprobs: Sequence[float],
) -> list[float]:
    """Sum the teacher's token logprobs onto the student's tokens by character position.

    A teacher token [s, e) goes to the student token whose span contains its last character
    e - 1 (for a zero-width token, position s); when no student span contains it, to the first
    student token starting after it, else to the last student token. Every teacher logprob is
    assigned once, so sum(result) == sum(teacher_logprobs) up to float rounding of the order.
    Returns one float per student token (0.0 for those that receive nothing).
    """
    if len(teacher_spans) != len(teacher_logprobs):
        raise ValueError(
            f"{len(teacher_spans)} teacher spans but {len(teacher_logprobs)} teacher logprobs."
        )
    if not student_spans:
        if teacher_spans:
            raise ValueError("no student tokens to align the teacher's logprobs to.")
        return []
    _check_student_spans(student_spans)
    starts = [s for s, _ in student_spans]
    out = [0.0] * len(student_spans)
    for (start, end), logprob in zip(teacher_spans, teacher_logprobs, strict=True):
        anchor = end - 1 if end > start else start
        i = bisect.bisect_right(starts, anchor) - 1
        if i < 0 or not starts[i] <= anchor < student_spans[i][1]:
            i = min(i + 1, len(student_spans) - 1)  # first student starting after the anchor
        out[i] += float(logprob)
    return out
