"""The two small tokenizers of the built-in models, each with its own chat template.

Both are trained (or, for the character tokenizer, listed) deterministically from the built-in
arithmetic task, and saved as an ordinary ``tokenizer.json`` + ``tokenizer_config.json`` pair that
``AutoTokenizer`` (a ``PreTrainedTokenizerFast``) and vLLM load.

``bpe`` (tiny-arith, tiny-arith-teacher): a byte-level BPE. Its chat template renders::

    <|bos|><|user|>What is 17 - 3?<|eos|><|assistant|>14<|eos|>

and with ``add_generation_prompt=True`` it ends with ``<|assistant|>``. Every turn ends with
``<|eos|>``, so the assistant's answer is followed by the eos token and generation stops there.

``char`` (tiny-arith-char): one token per character (printable ASCII and newline). Its template::

    <s><user>What is 17 - 3?
    <assistant>14</s>

A user or system turn ends with a newline, the assistant turn with the eos token ``</s>``.

Neither tokenizer adds special tokens when encoding plain text: the template writes the one bos
token, so ``apply_chat_template(..., tokenize=True)`` never doubles it. Pad is a token of its own
(never eos), so padding masks cannot hide a real eos.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import attrs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runner.data.arithmetic import problems


@attrs.frozen
class TokenizerSpec:
    """The special tokens and chat template of one tokenizer kind."""

    pad: str
    bos: str
    eos: str
    unk: str | None
    roles: dict[str, str]  # chat role -> the special token that opens its turn
    chat_template: str

    @property
    def specials(self) -> list[str]:
        """Special tokens in id order: pad=0, bos=1, eos=2, then roles (then unk)."""
        tokens = [self.pad, self.bos, self.eos, *self.roles.values()]
        return tokens + ([self.unk] if self.unk else [])


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

SPECS: dict[str, TokenizerSpec] = {
    "bpe": TokenizerSpec(
        pad="<|pad|>",
        bos="<|bos|>",
        eos="<|eos|>",
        unk=None,  # byte-level: every byte has a token, nothing is unknown
        roles={r: f"<|{r}|>" for r in ("system", "user", "assistant")},
        chat_template=_BPE_TEMPLATE,
    ),
    "char": TokenizerSpec(
        pad="<pad>",
        bos="<s>",
        eos="</s>",
        unk="<unk>",
        roles={r: f"<{r}>" for r in ("system", "user", "assistant")},
        chat_template=_CHAR_TEMPLATE,
    ),
}

BPE_VOCAB_SIZE = 384  # 256 bytes + 6 specials + 122 merges: every answer -20..40 is one token
CHAR_ALPHABET = "\n" + "".join(c for c in string.printable if c not in string.whitespace) + " "


def arithmetic_corpus() -> list[str]:
    """Questions and answers of the built-in training split, in a fixed order."""
    pool = problems("train", 2000, 0, 20, ("+", "-"), seed=0)
    return [text for p in pool for text in (p.question, str(p.answer))]


def train_bpe() -> Tokenizer:
    """A byte-level BPE trained on :func:`arithmetic_corpus`; identical on every call."""
    spec = SPECS["bpe"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=spec.specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(arithmetic_corpus(), trainer=trainer)
    return tok


def char_tokenizer() -> Tokenizer:
    """One token per character of :data:`CHAR_ALPHABET` (a BPE model without merges)."""
    spec = SPECS["char"]
    vocab = {token: i for i, token in enumerate(spec.specials)}
    for char in CHAR_ALPHABET:
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=spec.unk))
    tok.add_special_tokens(spec.specials)
    tok.decoder = decoders.Fuse()
    return tok


def build_tokenizer(kind: str) -> Tokenizer:
    """The tokenizer of ``kind`` ("bpe" or "char"), with its specials registered."""
    tok = train_bpe() if kind == "bpe" else char_tokenizer()
    tok.add_special_tokens(SPECS[kind].specials)  # no-op for ids, marks them special
    for i, token in enumerate(SPECS[kind].specials):
        if tok.token_to_id(token) != i:
            raise AssertionError(f"special token {token!r} has id {tok.token_to_id(token)}, not {i}")
    return tok


def save_tokenizer(tok: Tokenizer, kind: str, folder: Path) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` carrying the chat template."""
    spec = SPECS[kind]
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "unk_token": spec.unk,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "padding_side": "left",
        "extra_special_tokens": list(spec.roles.values()),
        "chat_template": spec.chat_template,
    }
    if spec.unk is None:
        del config["unk_token"]
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
