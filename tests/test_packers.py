"""DataPackers against real tokenizers: chat template, BOS/EOS rules, prompt-id reuse, collation."""

from __future__ import annotations

import pytest
import torch

from runner.errors import ExtensionError, RecipeError
from runner.packers import DataPacker, DecoderOnlyLLMDataPacker, build_packer, collate
from runner.rollout.base import Completion
from runner.types import ObsBundle

ITEM = ObsBundle("What is 3 + 4?", "7")


@pytest.fixture(scope="module", params=["builtin:tiny-arith", "builtin:tiny-arith-char"])
def packer(request):
    from runner.models import resolve_model_path

    return build_packer(resolve_model_path(request.param), "qwen2")


def test_rollout_input_has_one_bos(packer):
    tok = packer.tokenizer
    text = packer.get_rollout_input(ITEM)
    ids = packer.encode_rollout_input(text)
    assert "What is 3 + 4?" in text
    if tok.bos_token_id is not None:
        assert ids.count(tok.bos_token_id) <= 1
        assert ids[:2] != [tok.bos_token_id, tok.bos_token_id]
    assert packer.decode(ids, skip_special_tokens=False) == text


def test_policy_input_reuses_engine_prompt_ids(packer):
    prompt_ids = [5, 6, 7]  # deliberately not what the tokenizer would produce
    c = Completion((11, 12, packer.eos_token_id), "x", (0.0, 0.0, 0.0), "stop")
    x = packer.get_policy_input(ITEM, c, prompt_ids=prompt_ids)
    assert x.input_ids == (5, 6, 7, 11, 12, packer.eos_token_id)
    assert x.loss_mask == (0, 0, 0, 1, 1, 1)
    assert x.n_prompt_tokens == 3


def test_eos_never_missing_or_doubled(packer):
    eos = packer.eos_token_id
    stop = packer.get_policy_input(ITEM, Completion((11, eos), "", (0, 0), "stop"), prompt_ids=[1])
    cut = packer.get_policy_input(ITEM, Completion((11, 12), "", (0, 0), "length"), prompt_ids=[1])
    doubled = packer.get_policy_input(ITEM, Completion((11, eos, eos), "", (0,) * 3, "stop"),
                                      prompt_ids=[1])
    assert stop.completion_ids == (11, eos)
    assert cut.completion_ids == (11, 12)
    assert doubled.completion_ids == (11, eos)
    text = packer.get_policy_input(ITEM, "7", prompt_ids=[1])
    assert text.completion_ids.count(eos) == 1 and text.completion_ids[-1] == eos


def test_ignore_prefix_tokens(packer):
    c = Completion((11, 12, 13), "", (0, 0, 0), "length")
    x = packer.get_policy_input(ITEM, c, 2, prompt_ids=[1, 2])
    assert x.loss_mask == (0, 0, 0, 0, 1)


def test_rollout_and_policy_sides_agree_on_every_token(packer):
    """Generate with the real model, then rebuild the policy input on a *separate* instance."""
    from runner.rollout.base import SamplingConfig
    from runner.rollout.hf import HFEngine

    policy_side = build_packer(packer.model_path, "qwen2")
    assert policy_side is not packer
    engine = HFEngine.from_path(packer.model_path)
    prompt_ids = packer.encode_rollout_input(packer.get_rollout_input(ITEM))
    (out,) = engine.generate([prompt_ids], SamplingConfig(n=3, max_new_tokens=6, seed=1))
    for c in out.completions:
        x = policy_side.get_policy_input(ITEM, c, prompt_ids=out.prompt_ids)
        assert list(x.input_ids[: x.n_prompt_tokens]) == prompt_ids
        assert x.completion_ids[: len(c.token_ids)] == c.token_ids
        full_text = policy_side.decode(x.input_ids, skip_special_tokens=False)
        assert full_text.startswith(packer.get_rollout_input(ITEM))


def test_each_role_gets_a_fresh_instance():
    from runner.models import resolve_model_path

    path = resolve_model_path("builtin:tiny-arith")
    a, b = build_packer(path, "qwen2"), build_packer(path, "qwen2")
    assert a is not b and a.tokenizer is not b.tokenizer
    c = build_packer(path, "qwen2", "tests.extmods.packers.build_prefix_packer")
    d = build_packer(path, "qwen2", "tests.extmods.packers.build_prefix_packer")
    assert c is not d and type(c).__name__ == "PrefixPacker"
    assert c.get_rollout_input(ITEM).startswith("<domain>")


def test_unknown_model_type_and_bad_factory():
    from runner.models import resolve_model_path

    path = resolve_model_path("builtin:tiny-arith")
    with pytest.raises(RecipeError) as info:
        build_packer(path, "mamba-x")
    assert ("model.model_type" in info.value.lines()[0]
            and "data_packer.factory" in info.value.lines()[0])
    with pytest.raises(ExtensionError) as info:
        build_packer(path, "qwen2", "tests.extmods.callables.two_kwargs")
    assert ("tests.extmods.callables.two_kwargs: returned list, not a DataPacker"
            in info.value.lines()[0])


def test_collate_pads_right_and_packs():
    from runner.packers import RLPolicyInput

    xs = [RLPolicyInput((1, 2, 3), (0, 1, 1), 1), RLPolicyInput((4, 5), (0, 1), 1)]
    b = collate(xs, pad_token_id=0)
    assert b.input_ids_BT.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert b.attention_mask_BT.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b.position_ids_BT.tolist() == [[0, 1, 2], [0, 1, 1]]
    assert b.loss_mask_BT.tolist() == [[0, 1, 1], [0, 1, 0]]
    p = collate(xs, pad_token_id=0, packed=True)
    assert p.input_ids_BT.tolist() == [[1, 2, 3, 4, 5]]
    assert p.position_ids_BT.tolist() == [[0, 1, 2, 0, 1]]
    assert p.seq_ids_BT.tolist() == [[0, 0, 0, 1, 1]]


def test_packed_logprobs_equal_padded():
    """Padding-free packing gives the same per-token logprobs as padding (block-diagonal mask)."""
    from runner.models import load_causal_lm, resolve_model_path
    from runner.packers import RLPolicyInput
    from runner.train.roles.policy import batch_logprobs

    model = load_causal_lm(resolve_model_path("builtin:tiny-arith")).eval()
    xs = [RLPolicyInput((1, 20, 30, 40), (0, 0, 1, 1), 2), RLPolicyInput((1, 50, 60), (0, 1, 1), 1)]
    with torch.no_grad():
        lp_pad, mask_pad = batch_logprobs(model, collate(xs, 0))
        lp_pack, mask_pack = batch_logprobs(model, collate(xs, 0, packed=True))
    padded = lp_pad[mask_pad]
    packed = lp_pack[mask_pack]
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)


def test_abstract_base_cannot_be_instantiated():
    with pytest.raises(TypeError):
        DataPacker()  # type: ignore[abstract]
    assert issubclass(DecoderOnlyLLMDataPacker, DataPacker)


# --- DPO answer payloads ----------------------------------------------------------------------

PAIR = ObsBundle("What is 3 + 4?", id="train-3")


@pytest.mark.parametrize("chosen, rejected", [
    ("7", "8"),
    ({"text": "7"}, {"text": "8"}),
    ({"sample": "7"}, {"sample": "8"}),
    ({"role": "assistant", "content": "7"}, {"role": "assistant", "content": "8"}),
    ([{"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "8"}]),
], ids=["text", "text-field", "sample-field", "one-message", "message-list"])
def test_preference_payload_shapes_pack_like_plain_text(packer, chosen, rejected):
    want = packer.get_preference_input(PAIR, "7", "8")
    assert packer.get_preference_input(PAIR, chosen, rejected) == want
    c, r = want
    assert c.completion_ids == (*packer.tokenizer("7", add_special_tokens=False)["input_ids"],
                                packer.eos_token_id)
    assert c.input_ids[:c.n_prompt_tokens] == r.input_ids[:r.n_prompt_tokens]


@pytest.mark.parametrize("payload, found", [
    ({"image": "a.png", "caption": "x"}, "a mapping with keys ['caption', 'image']"),
    ({"text": "7", "sample": "7"}, "a mapping with keys ['sample', 'text']"),
    ({"text": 7}, "a mapping with keys ['text']"),
    ({"role": "user", "content": "7"}, "a mapping with keys ['content', 'role']"),
    ([{"role": "assistant", "content": "7"}] * 2, "a list of 2 element(s)"),
    (7, "a int"),
], ids=["other-keys", "two-fields", "not-text", "user-role", "two-messages", "number"])
def test_other_payload_shapes_are_a_recipe_error_naming_pair_and_keys(packer, payload, found):
    with pytest.raises(RecipeError) as info:
        packer.get_preference_input(PAIR, payload, payload)
    (line,) = info.value.lines()
    assert line.startswith(f"data_packer.factory: pair train-3: the chosen answer is {found}")
    assert "'text', 'content', 'sample'" in line and "packer subclass" in line


def test_answer_text_doctests():
    import doctest

    from runner.packers import decoder_only

    assert doctest.testmod(decoder_only).failed == 0


# --- the contract declared on the base class ---------------------------------------------------

def test_a_packer_missing_a_method_the_loops_call_fails_when_built():
    from runner.models import resolve_model_path

    path = resolve_model_path("builtin:tiny-arith")
    with pytest.raises(ExtensionError) as info:
        build_packer(path, "qwen2", "tests.extmods.packers.build_incomplete_packer")
    (line,) = info.value.lines()
    assert line.startswith("data_packer.factory: tests.extmods.packers.build_incomplete_packer: "
                           "raised TypeError when called: ")
    for name in ("decode", "encode_with_offsets", "eos_token_id", "get_preference_input"):
        assert name in line
    assert "subclass runner.packers.DecoderOnlyLLMDataPacker" in line


def test_model_options_reach_the_packer_before_setup():
    from runner.models import resolve_model_path

    path = resolve_model_path("builtin:tiny-arith")
    seen = build_packer(path, "qwen2", "tests.extmods.packers.build_recording_packer",
                        trust_remote_code=True, dtype="bfloat16").seen_at_setup
    assert seen == (True, "bfloat16")
    default = build_packer(path, "qwen2", "tests.extmods.packers.build_recording_packer")
    assert default.seen_at_setup == (False, "float32")


def test_trust_remote_code_reaches_the_tokenizer_load(monkeypatch):
    from runner import models
    from runner.models import resolve_model_path

    path = resolve_model_path("builtin:tiny-arith")
    calls = []
    real = models.load_tokenizer
    monkeypatch.setattr(
        models, "load_tokenizer",
        lambda p, trust_remote_code=False: calls.append(trust_remote_code) or real(p))
    build_packer(path, "qwen2", trust_remote_code=True)
    build_packer(path, "qwen2")
    assert calls == [True, False]


def test_encode_with_offsets_spans_the_text(packer):
    text = "What is 12 + 30?"
    ids, spans = packer.encode_with_offsets(text)
    assert ids == packer.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(spans) == len(ids) and spans[0][0] == 0 and spans[-1][1] == len(text)
    assert "".join(text[a:b] for a, b in spans).replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize("name", ["builtin:tiny-arith", "builtin:tiny-arith-char",
                                  "builtin:tiny-code", "builtin:tiny-arith-tools"])
def test_plain_encoding_equals_the_tokenizers_own_call(name):
    """The built-in packers encode through the tokenizer's Rust backend directly: the same ids
    and spans as the tokenizer's call, special tokens in the text included, and the call
    itself whenever the backend is set otherwise (truncation left by an earlier call, special
    tokens split)."""
    from runner.models import load_tokenizer
    from runner.packers.decoder_only import _direct_backend, plain_encoding

    tok = load_tokenizer(name)
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"},
                                        {"role": "assistant", "content": "7"}], tokenize=False)
    texts = [rendered, "What is 12 + 30?", "", "  two  spaces\nand a line", "é ü 中 🙂",
             f"{tok.eos_token}{tok.eos_token}x", "1234567890" * 8]

    def called(text, **kw):
        out = tok(text, add_special_tokens=False, return_offsets_mapping=True, **kw)
        return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]

    assert _direct_backend(tok) is not None  # the direct path is the one taken here
    for text in texts:
        assert plain_encoding(tok, text, offsets=True) == called(text)
        assert plain_encoding(tok, text) == (called(text)[0], [])
    assert tok.eos_token_id in plain_encoding(tok, rendered + tok.eos_token)[0]

    long = texts[-1]
    short = called(long, truncation=True, max_length=3)[0]  # leaves truncation on the backend
    assert len(short) == 3 and _direct_backend(tok) is None
    assert plain_encoding(tok, long)[0] == called(long)[0] and len(called(long)[0]) > 3

    whole = plain_encoding(tok, rendered)[0]
    tok.split_special_tokens = True  # the call splits special tokens: so does plain_encoding
    try:
        split = plain_encoding(tok, rendered)[0]
        assert split == called(rendered)[0] == plain_encoding(tok, rendered)[0]
        assert len(split) > len(whole)  # the template's special tokens, spelled out
    finally:
        tok.split_special_tokens = False
