"""The small tokenizers of the built-in models, each with its own chat template.

Both use exactly the text pipeline of transformers' ``Qwen2Tokenizer`` (NFC, the Qwen
pre-tokenizer regex, byte-level symbols, byte-level decoder). This matters: for a folder whose
``config.json`` says ``model_type: qwen2``, ``AutoTokenizer`` (and so vLLM) ignores
``tokenizer_class`` and builds a ``Qwen2Tokenizer`` from the vocab and merges of
``tokenizer.json`` with its own pipeline. Using that pipeline here makes every loader —
``tokenizers.Tokenizer``, ``PreTrainedTokenizerFast``, ``AutoTokenizer``, vLLM — produce the same
ids. The Qwen regex splits numbers into single digits, so answers are written digit by digit.

``bpe`` (tiny-arith, tiny-arith-teacher): a byte-level BPE trained on the arithmetic text (merges
for words such as ``What`` and `` is``). Its chat template renders::

    <|bos|><|user|>What is 17 - 3?<|eos|><|assistant|>14<|eos|>

and with ``add_generation_prompt=True`` it ends with ``<|assistant|>``. Every turn ends with
``<|eos|>``, so the assistant's answer is followed by the eos token and generation stops there.

``char`` (tiny-arith-char): the same byte alphabet with no merges, so one token per character of
ASCII text, with other special tokens, other ids and another template::

    <s><user>What is 17 - 3?
    <assistant>14</s>

A user or system turn ends with a newline, the assistant turn with the eos token ``</s>``.

``tools`` (tiny-arith-tools): the special tokens, ids and text pipeline of ``bpe``, a byte-level
BPE trained on the text of the tool and guess transcripts (``runner.models.transcripts``), no
whole-number tokens (every digit is a token of its own), and four added tokens that are *not*
special, so that decoding with ``skip_special_tokens=True`` keeps them: ``<tool_call>``,
``</tool_call>``, ``<tool_response>``, ``</tool_response>``. Its template opens with a system
turn that lists the tools (OpenAI-style function schemas) when ``tools`` is given, and renders a
``tool`` message as a user turn wrapped in ``<tool_response>``::

    <|bos|><|system|>tools: add(a, b), mul(a, b)<|eos|><|user|>What is 47 * 86?<|eos|>
    <|assistant|><tool_call>{"name": "mul", "arguments": {"a": 47, "b": 86}}</tool_call><|eos|>
    <|user|><tool_response>4042</tool_response><|eos|><|assistant|>4042<|eos|>

(one line; broken here for reading). The rendering only appends: a longer conversation's ids
start with a shorter one's, so a multi-turn rollout can extend its prompt in place.

No tokenizer adds special tokens when encoding plain text: the template writes the one bos
token, so ``apply_chat_template(..., tokenize=True)`` never doubles it. Pad is a token of its own
(never eos), so a padding mask cannot hide a real eos. Special ids: pad 0, bos 1, eos 2, then the
role tokens system 3, user 4, assistant 5, then unk 6 (never produced: every byte has a token).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from runner.data.arithmetic import problems
from runner.models.transcripts import corpus_texts

# Must equal transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (a test checks it).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BPE_VOCAB_SIZE = 512  # an upper bound: the arithmetic text runs out of merges well before it
NUMBER_TOKENS = [str(n) for n in range(10, 100)]  # whole-number tokens of the bpe kind
MODEL_MAX_LENGTH = 256


@attrs.frozen
class TokenizerSpec:
    """The special tokens and chat template of one tokenizer kind."""

    pad: str
    bos: str
    eos: str
    roles: tuple[str, str, str]  # the tokens opening a system, user and assistant turn
    unk: str
    chat_template: str

    @property
    def specials(self) -> list[str]:
        """Special tokens in id order: pad 0, bos 1, eos 2, system 3, user 4, assistant 5, unk 6."""
        return [self.pad, self.bos, self.eos, *self.roles, self.unk]


_BPE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_CHAR_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<' + message['role'] + '>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)

_TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>tools: ' }}"
    "{% for tool in tools %}"
    "{% if not loop.first %}{{ ', ' }}{% endif %}"
    "{{ tool['function']['name'] + '(' }}"
    "{{ tool['function']['parameters']['properties'] | list | join(', ') }}"
    "{{ ')' }}"
    "{% endfor %}"
    "{{ eos_token }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|><tool_response>' + message['content'] + '</tool_response>' + eos_token }}"
    "{% elif message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% else %}"
    "{{ raise_exception('roles must be system, user, assistant or tool') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# The added, non-special marker tokens of the "tools" kind, in id order after the trained vocab.
TOOL_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

SPECS: dict[str, TokenizerSpec] = {
    "bpe": TokenizerSpec(
        pad="<|pad|>",
        bos="<|bos|>",
        eos="<|eos|>",
        roles=("<|system|>", "<|user|>", "<|assistant|>"),
        unk="<|unk|>",
        chat_template=_BPE_TEMPLATE,
    ),
    "char": TokenizerSpec(
        pad="<pad>",
        bos="<s>",
        eos="</s>",
        roles=("<system>", "<user>", "<assistant>"),
        unk="<unk>",
        chat_template=_CHAR_TEMPLATE,
    ),
    "code": TokenizerSpec(
        pad="<|pad|>",
        bos="<|bos|>",
        eos="<|eos|>",
        roles=("<|system|>", "<|user|>", "<|assistant|>"),
        unk="<|unk|>",
        chat_template=_BPE_TEMPLATE,
    ),
    "tools": TokenizerSpec(
        pad="<|pad|>",
        bos="<|bos|>",
        eos="<|eos|>",
        roles=("<|system|>", "<|user|>", "<|assistant|>"),
        unk="<|unk|>",
        chat_template=_TOOLS_TEMPLATE,
    ),
}


def byte_symbols() -> list[str]:
    """The 256 byte-level symbols in byte order (GPT-2's reversible byte -> unicode map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _qwen2_pipeline(tok: Tokenizer) -> Tokenizer:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _trained_bpe(kind: str, texts: list[str]) -> Tokenizer:
    """A byte-level BPE of the Qwen2 pipeline trained on ``texts`` (at most ``BPE_VOCAB_SIZE``
    tokens, merges seen twice or more), with ``kind``'s special tokens first."""
    tok = _qwen2_pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECS[kind].specials,
        initial_alphabet=byte_symbols(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def arithmetic_corpus() -> list[str]:
    """Questions and answers of the built-in training split, in a fixed order."""
    pool = problems("train", 2000, 0, 20, ("+", "-", "*"), seed=0)
    return [text for p in pool for text in (p.question, str(p.answer))]


def train_bpe() -> Tokenizer:
    """A byte-level BPE trained on :func:`arithmetic_corpus`; identical on every call."""
    tok = _trained_bpe("bpe", arithmetic_corpus())
    tok.add_tokens([AddedToken(n, normalized=False) for n in NUMBER_TOKENS])
    return tok


def tools_corpus() -> list[str]:
    """The text of the warm-up transcripts of ``tiny-arith-tools``, markers cut out (they are
    added tokens, never merged), in a fixed order."""
    texts = []
    for text in corpus_texts():
        for marker in TOOL_MARKERS:
            text = text.replace(marker, "\n")
        texts += [piece for piece in text.split("\n") if piece]
    return texts


def train_tools_bpe() -> Tokenizer:
    """A byte-level BPE trained on :func:`tools_corpus`, plus the four non-special markers."""
    tok = _trained_bpe("tools", tools_corpus())
    tok.add_tokens([AddedToken(m, normalized=False, special=False) for m in TOOL_MARKERS])
    return tok


def code_corpus() -> list[str]:
    """Questions and programs (right and one short) of the built-in code task's training split."""
    from runner.data.code_task import problems as code_problems

    pool = code_problems("train", 400)
    return [text for p in pool for text in (p.question, p.program(), p.program(slip=True))]


def train_code_bpe() -> Tokenizer:
    """A byte-level BPE trained on :func:`code_corpus`, plus the whole numbers 10..99."""
    tok = _trained_bpe("code", code_corpus())
    tok.add_tokens([AddedToken(n, normalized=False) for n in NUMBER_TOKENS])
    return tok


def char_tokenizer() -> Tokenizer:
    """One token per byte (so per character of ASCII text): a byte-level BPE with no merges."""
    spec = SPECS["char"]
    vocab = {token: i for i, token in enumerate(spec.specials)}
    for symbol in byte_symbols():
        vocab[symbol] = len(vocab)
    return _qwen2_pipeline(Tokenizer(models.BPE(vocab=vocab, merges=[])))


def build_tokenizer(kind: str) -> Tokenizer:
    """The tokenizer of ``kind`` ("bpe", "char", "tools" or "code") with its special tokens at
    ids 0..6."""
    builders = {"bpe": train_bpe, "char": char_tokenizer, "tools": train_tools_bpe,
                "code": train_code_bpe}
    tok = builders[kind]()
    tok.add_special_tokens(SPECS[kind].specials)
    for i, token in enumerate(SPECS[kind].specials):
        if tok.token_to_id(token) != i:
            raise AssertionError(
                f"special token {token!r} has id {tok.token_to_id(token)}, not {i}")
    return tok


def tokenizer_config(kind: str) -> dict[str, object]:
    """The ``tokenizer_config.json`` of ``kind``: special tokens, no automatic bos, the template."""
    spec = SPECS[kind]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "unk_token": spec.unk,
        "extra_special_tokens": list(spec.roles),
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "chat_template": spec.chat_template,
    }


def save_tokenizer(tok: Tokenizer, kind: str, folder: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)."""
    tok.save(str(folder / "tokenizer.json"))
    text = json.dumps(tokenizer_config(kind), indent=2, sort_keys=True) + "\n"
    (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
