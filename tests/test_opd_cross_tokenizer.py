"""OPD across tokenizers: one model behind two tokenizers, scored through the real teacher path.

The model is builtin:tiny-arith. Its BPE tokenizer is one view: merges such as "What", " is",
" +" and whole-number tokens "10".."99". The other view is the same vocabulary with those merges
and number tokens removed (``char_view``): every byte symbol is in the BPE vocabulary, so the same
text becomes one token per character, with the same ids for single characters and the same
special tokens, and the same weights score it. A model folder with that tokenizer is a teacher
with "its own tokenizer" in ``cross_token_multimodal`` mode.

``Teacher.logprobs`` then runs exactly what an OPD step runs: the student-codec packer (built
from the student's factory) decodes each completion, the teacher packer re-encodes the prompt
and the completion text, the teacher scores its own tokens, and ``align_to_student`` sums them
onto the student's tokens by character spans.

Two tokenisations of one text do not give one sequence logprob under one model (the factorisation
differs), so the statement tested is about the aligned side: the aligned values sum to the
teacher's sequence logprob of the completion, computed here independently (the teacher's ids
written by hand, one forward pass, log-softmax, gather), and each student token receives exactly
the teacher logprobs of the teacher tokens ending inside its characters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runner.models import load_causal_lm, load_tokenizer, resolve_model_path
from runner.models.tokenizer_build import byte_symbols
from runner.packers import build_packer
from runner.recipe.schema import Recipe
from runner.rollout.base import Completion
from runner.train.loops.trajectory import Trajectory
from runner.train.roles import Frozen
from runner.train.roles.teacher import Teacher
from runner.types import ObsBundle

EOS = 2  # both views: pad 0, bos 1, eos 2, system 3, user 4, assistant 5, unk 6
QUESTION = "What is 17 + 25?"
# (completion text, finish reason): answers with whole-number tokens, text with merges, nothing
COMPLETIONS = [("42", "stop"), ("What is 17 + 3", "length"), (" 96 - 8", "stop"), ("", "stop")]


@pytest.fixture(scope="module")
def bpe_view() -> Path:
    return resolve_model_path("builtin:tiny-arith")


@pytest.fixture(scope="module")
def char_view(bpe_view, tmp_path_factory) -> Path:
    """tiny-arith's weights behind its own vocabulary with no merges and no number tokens."""
    folder = tmp_path_factory.mktemp("tiny-arith-char-view")
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer_config.json"):
        shutil.copy(bpe_view / name, folder / name)
    spec = json.loads((bpe_view / "tokenizer.json").read_text())
    assert spec["model"]["merges"] and len(spec["added_tokens"]) > 7  # something to remove
    spec["model"]["merges"] = []
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["special"]]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def _char_ids(text: str, vocab: dict[str, int]) -> list[int]:
    """One id per UTF-8 byte: the byte symbol's id in the vocabulary (independent of the tokenizer
    pipeline)."""
    symbols = byte_symbols()
    return [vocab[symbols[b]] for b in text.encode()]


def _teacher(student: Path, teacher: Path) -> Teacher:
    """The OPD cross-tokenizer teacher of a student folder: the teacher's model and packer, and
    a student-codec packer."""
    return Teacher(Frozen(teacher, Recipe(), "cpu"), "cross_token_multimodal",
                   torch.device("cpu"), build_packer(student, "qwen2").pad_token_id,
                   student_codec=build_packer(student, "qwen2"),
                   packer=build_packer(teacher, "qwen2"))


def _trajectory(student: Path) -> tuple[Trajectory, list]:
    """Hand-written completions of QUESTION in the student's tokens, and their policy inputs."""
    packer = build_packer(student, "qwen2")
    item = ObsBundle(QUESTION)
    prompt_ids = tuple(packer.encode_rollout_input(packer.get_rollout_input(item)))
    completions = []
    for text, finish in COMPLETIONS:
        ids = list(packer.tokenizer(text, add_special_tokens=False)["input_ids"])
        completions.append(Completion(tuple(ids + [EOS] * (finish == "stop")), text, (), finish))
    n = len(completions)
    traj = Trajectory((item,) * n, (prompt_ids,) * n, tuple(completions))
    return traj, traj.policy_inputs(packer)


def _aligned(teacher: Teacher, traj: Trajectory, inputs: list,
             temperature: float) -> list[list[float]]:
    """Teacher.logprobs on the student's grid, read back per completion token."""
    width = max(len(x.input_ids) for x in inputs) - 1
    grid = teacher.logprobs(traj, inputs, width, temperature)
    return [grid[b, x.n_prompt_tokens - 1:len(x.input_ids) - 1].tolist()
            for b, x in enumerate(inputs)]


@torch.no_grad()
def _scores(model, prompt_ids: list[int], completion_ids: list[int],
            temperature: float) -> list[float]:
    """log softmax(logits / T) of each completion token given everything before it."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double() / temperature, dim=-1)
    targets = ids[0, 1:]
    lp = logp.gather(-1, targets[:, None])[:, 0]
    return lp[len(prompt_ids) - 1:].tolist()


def _spans(pieces: list[str]) -> list[tuple[int, int]]:
    out, pos = [], 0
    for piece in pieces:
        out.append((pos, pos + len(piece)))
        pos += len(piece)
    return out


def _owner(student_spans: list[tuple[int, int]], start: int, end: int) -> int:
    """The student token holding the teacher token's last character; a zero-width token at the
    end (the teacher's eos) belongs to the student's last token (its eos)."""
    if end == start:
        return len(student_spans) - 1
    return next(i for i, (s, e) in enumerate(student_spans) if s <= end - 1 < e)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bpe_student_char_teacher_one_model(bpe_view, char_view, temperature):
    """Student: the BPE view. Teacher: the same weights behind the character view."""
    teacher = _teacher(bpe_view, char_view)
    traj, inputs = _trajectory(bpe_view)
    aligned = _aligned(teacher, traj, inputs, temperature)

    model = load_causal_lm(bpe_view)
    bpe, vocab = load_tokenizer(bpe_view), load_tokenizer(char_view).get_vocab()
    assert vocab == {k: v for k, v in bpe.get_vocab().items() if v < len(vocab)}  # one id space
    sample = "What is 42"
    assert (teacher.packer.tokenizer(sample, add_special_tokens=False)["input_ids"]
            == _char_ids(sample, vocab))
    assert len(bpe(sample, add_special_tokens=False)["input_ids"]) == 4  # "What", " is", " ", "42"
    # The teacher's prompt, written out by hand: its template with the question spelled per byte.
    prompt = [1, 4, *_char_ids(QUESTION, vocab), EOS, 5]
    multi = 0
    for (text, finish), c, values in zip(COMPLETIONS, traj.completions, aligned, strict=True):
        teacher_ids = _char_ids(text, vocab) + [EOS] * (finish == "stop")
        lp = _scores(model, prompt, teacher_ids, temperature)
        assert len(values) == len(c.token_ids)
        # the aligned values sum to the teacher's sequence logprob of the completion
        assert sum(values) == pytest.approx(sum(lp), abs=1e-5)
        # and each student token holds the logprobs of exactly its own characters (and eos its eos)
        pieces = [bpe.decode([t], skip_special_tokens=True) for t in c.token_ids]
        assert "".join(pieces) == text
        expected = [0.0] * len(pieces)
        for j, (s, e) in enumerate(_spans([text[k] for k in range(len(text))])):
            expected[_owner(_spans(pieces), s, e)] += lp[j]
        if finish == "stop":
            expected[-1] += lp[-1]
        assert values == pytest.approx(expected, abs=1e-5)
        multi += sum(len(p) > 1 for p in pieces)
    assert multi >= 5  # "42", "What", " is", "17", " -", ...: spans of several teacher tokens


def test_char_student_bpe_teacher_one_model(bpe_view, char_view):
    """The other direction: student on the character view, teacher the BPE view, one model.
    Each BPE token's logprob lands on the character holding its last character."""
    teacher = _teacher(char_view, bpe_view)
    traj, inputs = _trajectory(char_view)
    aligned = _aligned(teacher, traj, inputs, 1.0)

    model = load_causal_lm(bpe_view)
    bpe = load_tokenizer(bpe_view)
    prompt = bpe(bpe.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    assert prompt[:2] == [1, 4] and prompt[-2:] == [EOS, 5]
    merged = 0
    for (text, finish), c, values in zip(COMPLETIONS, traj.completions, aligned, strict=True):
        assert len(c.token_ids) == len(text.encode()) + (finish == "stop")  # one per character
        teacher_ids = (list(bpe(text, add_special_tokens=False)["input_ids"])
                       + [EOS] * (finish == "stop"))
        lp = _scores(model, list(prompt), teacher_ids, 1.0)
        assert sum(values) == pytest.approx(sum(lp), abs=1e-5)
        student = _spans([text[k] for k in range(len(text))] + [""] * (finish == "stop"))
        teacher_spans = _spans([bpe.decode([t], skip_special_tokens=True) for t in teacher_ids])
        expected = [0.0] * len(student)
        for (s, e), value in zip(teacher_spans, lp, strict=True):
            expected[_owner(student, s, e)] += value
        assert values == pytest.approx(expected, abs=1e-5)
        # characters inside a merged teacher token receive nothing
        merged += sum(1 for s, e in teacher_spans if e - s > 1)
        assert sum(v == 0.0 for v in values) == sum(e - s - 1 for s, e in teacher_spans if e > s)
    assert merged >= 5


def test_same_tokenizer_through_the_cross_path_is_the_student_itself(bpe_view):
    """Teacher = the student's own folder: the cross-tokenizer path must give back the student's
    token logprobs (same prompt encoding, same ids, one span each)."""
    traj, inputs = _trajectory(bpe_view)
    aligned = _aligned(_teacher(bpe_view, bpe_view), traj, inputs, 0.7)
    model = load_causal_lm(bpe_view)
    for x, values in zip(inputs, aligned, strict=True):
        lp = _scores(model, list(x.input_ids[:x.n_prompt_tokens]), list(x.completion_ids), 0.7)
        assert values == pytest.approx(lp, abs=1e-5)
