"""Build a tiny Qwen2 arithmetic model: tokenizer, random init, supervised warm-up, save.

A randomly initialised model cannot learn arithmetic by RL in a few minutes: it almost never
samples a right answer, so every reward is zero. The warm-up is a supervised run on the built-in
training split (prompt through the chat template, then the answer and eos; the loss is on the
answer and eos only). Held-out problems are never trained on.

What we measured, and why ``tiny-arith`` has a *slip*: a clean warm-up stopped early (greedy
held-out accuracy ~30%) leaves a model whose answers are a broad bump around the right number;
GRPO on the built-in recipe then did not raise held-out accuracy at all in 300 steps (lr 1e-4 or
3e-4): the exact-match reward is too weak a signal to teach the missing precision in minutes.
So the warm-up of ``tiny-arith`` trains longer (a precise model) on answers of which a share
(``slip``) is written one too high: the model learns that habit, and its greedy answer is often
the wrong one of two near-tied candidates while sampling still finds the right one. GRPO removes
a systematic habit quickly: held-out accuracy went from 0.28 to 0.55-0.62 within 20-60 steps of
``recipes/grpo-arith.toml``. The teacher and the char model are warmed up without slip.

The build is deterministic on one machine (``runner.models.build_env``); the folders it made are
shipped with the package, so a run never builds them (``python -m runner.models.rebuild``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from runner.data.arithmetic import Problem, problems
from runner.models.build_env import (
    cpu_description,
    deterministic_torch,
    quiet_transformers_progress,
    warm_up_loop,
)
from runner.models.specs import TinySpec
from runner.models.tokenizer_build import MODEL_MAX_LENGTH, build_tokenizer, save_tokenizer

TASK = (0, 20, ("+", "-"))  # the built-in task: operands 0..20, + and -
HELD_OUT_EVAL = 200  # held-out problems measured after the warm-up
MAX_ANSWER_TOKENS = 6  # "-20" is 2 tokens (bpe) or 3 (char), plus eos
RESTATED_TOKENS = 16  # "-20 (0 - 20)" and eos, with room


def model_config(spec: TinySpec, tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    """A standard Qwen2 config (vLLM loads it as is): vocab = the tokenizer's, tied embeddings."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """The chat-templated prompt of one question, ending with the assistant header."""
    messages = [{"role": "user", "content": question}]
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"])


def answer_ids(tokenizer: PreTrainedTokenizerBase, answer: int | str) -> list[int]:
    """The answer's tokens followed by eos, exactly as the chat template renders them."""
    return tokenizer.encode(str(answer), add_special_tokens=False) + [tokenizer.eos_token_id]


def answer_text(spec: TinySpec, question: str, answer: int) -> str:
    """How the warm-up writes ``answer``: the integer, or with ``spec.restate`` the integer
    followed by the question's expression in parentheses.

    >>> answer_text(TinySpec("bpe", 8, 1, 1, 1e-3, restate=True), "What is 17 - 3?", 14)
    '14 (17 - 3)'
    """
    if not spec.restate:
        return str(answer)
    return f"{answer} ({question.removeprefix('What is ').rstrip('?')})"


def warm_up_examples(spec: TinySpec) -> list[tuple[str, int]]:
    """The (question, answer) pairs of the warm-up, one batch after another, in a fixed order.

    With ``spec.slip`` > 0 that share of the answers is written one too high (drawn from a
    seeded RNG): a deliberate, systematic habit that an exact-match reward can train away.
    """
    train = problems("train", spec.steps * spec.batch_size, 0, spec.warmup_hi, TASK[2], spec.seed)
    rng = random.Random(f"slip-{spec.seed}")
    return [(p.question, p.answer + (rng.random() < spec.slip)) for p in train]


def sft_batch(
    tokenizer: PreTrainedTokenizerBase, batch: Sequence[tuple[str, int | str]]
) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 off the answer),
    [B, T]."""
    return padded_batch(tokenizer, [(prompt_ids(tokenizer, q), answer_ids(tokenizer, a))
                                    for q, a in batch])


def padded_batch(tokenizer: PreTrainedTokenizerBase, rows: Sequence[tuple[list[int], list[int]]]
                 ) -> dict[str, torch.Tensor]:
    """(prompt ids, answer ids) rows right-padded into ``input_ids``, ``attention_mask`` and
    ``labels`` (-100 off the answer), [B, T]."""
    width = max(len(q) + len(a) for q, a in rows)
    pad = tokenizer.pad_token_id
    input_ids, mask, labels = [], [], []
    for q, a in rows:
        fill = width - len(q) - len(a)
        input_ids.append(q + a + [pad] * fill)
        mask.append([1] * (len(q) + len(a)) + [0] * fill)
        labels.append([-100] * len(q) + a + [-100] * fill)
    return {
        "input_ids": torch.tensor(input_ids),
        "attention_mask": torch.tensor(mask),
        "labels": torch.tensor(labels),
    }


@torch.no_grad()
def generate_ids(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase,
                 prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float,
                 generator: torch.Generator) -> list[list[int]]:
    """The generated ids of each prompt (greedy when ``temperature`` is 0), up to eos (not
    kept): a small KV-cached loop over left-padded prompts (positions follow the attention
    mask), the same arithmetic as ``model.generate`` without its per-call overhead."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    width = max(map(len, prompts))
    step_ids_BT = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask_BT = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    done_B = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    past = None
    for _ in range(max_new_tokens):
        position_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)[:, -step_ids_BT.shape[1] :]
        result = model(input_ids=step_ids_BT, attention_mask=mask_BT, position_ids=position_BT,
                       past_key_values=past, use_cache=True)
        past = result.past_key_values
        logits_BV = result.logits[:, -1].float()
        if temperature > 0:
            probs_BV = torch.softmax(logits_BV / temperature, dim=-1)
            next_B = torch.multinomial(probs_BV, 1, generator=generator)[:, 0]
        else:
            next_B = logits_BV.argmax(-1)
        for i, token in enumerate(next_B.tolist()):
            if not done_B[i] and token != eos:
                out[i].append(token)
        done_B |= next_B == eos
        if done_B.all():
            break
        step_ids_BT = next_B[:, None]
        mask_BT = torch.cat([mask_BT, torch.ones_like(step_ids_BT)], dim=1)
    return out


def generate_answers(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    *,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 100,
    max_new_tokens: int = MAX_ANSWER_TOKENS,
) -> list[str]:
    """Completions of ``questions`` (greedy when ``temperature`` is 0), decoded up to eos
    (``generate_ids``, ``batch_size`` questions at a time)."""
    generator = torch.Generator().manual_seed(seed)
    texts: list[str] = []
    for start in range(0, len(questions), batch_size):
        prompts = [prompt_ids(tokenizer, q) for q in questions[start : start + batch_size]]
        out = generate_ids(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                           temperature=temperature, generator=generator)
        texts += [tokenizer.decode(toks, skip_special_tokens=True) for toks in out]
    return texts


def accuracy(completions: Sequence[str], items: Sequence[Problem]) -> float:
    """Share of completions that are exactly the integer answer (surrounding spaces allowed)."""
    right = sum(text.strip() == str(p.answer) for text, p in zip(completions, items, strict=True))
    return right / len(items)


def first_integer_accuracy(completions: Sequence[str], items: Sequence[Problem]) -> float:
    """Share of completions whose first integer is the answer (whatever follows it)."""
    def first(text: str) -> str:
        found = re.search(r"-?\d+", text)
        return found.group() if found else ""

    return sum(first(t) == str(p.answer) for t, p in zip(completions, items, strict=True)
               ) / len(items)


def held_out_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    count: int = HELD_OUT_EVAL,
    temperature: float = 0.0,
    judge: Any = None,
    max_new_tokens: int = MAX_ANSWER_TOKENS,
) -> float:
    """Accuracy on ``problems("held_out", count, 0, 20, ("+", "-"))`` by ``judge`` (default
    ``accuracy``: exactly the integer answer); greedy by default."""
    items = problems("held_out", count, *TASK)
    completions = generate_answers(model, tokenizer, [p.question for p in items],
                                   temperature=temperature, max_new_tokens=max_new_tokens)
    return (judge or accuracy)(completions, items)


def warm_up(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, spec: TinySpec, label: str
) -> list[float]:
    """The supervised warm-up (``build_env.warm_up_loop``) on ``warm_up_examples(spec)``."""
    examples = [(q, answer_text(spec, q, a)) for q, a in warm_up_examples(spec)]
    size = spec.batch_size
    return warm_up_loop(
        model,
        lambda step: sft_batch(tokenizer, examples[step * size : (step + 1) * size]),
        spec.steps, spec.lr, label,
    )


def build_tiny(folder: Path, name: str, spec: TinySpec) -> dict[str, object]:
    """Write the complete model folder of ``spec`` into ``folder``; returns its build info."""
    console = Console(stderr=True)
    console.print(f"building builtin:{name} ...")
    with deterministic_torch():
        save_tokenizer(build_tokenizer(spec.tokenizer), spec.tokenizer, folder)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(model_config(spec, tokenizer))
        losses = warm_up(model, tokenizer, spec, name)
        greedy = held_out_accuracy(model, tokenizer)
        sampled = held_out_accuracy(model, tokenizer, temperature=1.0)
        # a restating model's replies are longer; its first integer is its answer
        first = (held_out_accuracy(model, tokenizer, judge=first_integer_accuracy,
                                   max_new_tokens=RESTATED_TOKENS) if spec.restate else None)
        save_greedy(model, tokenizer, folder,
                    max_new_tokens=RESTATED_TOKENS if spec.restate else 8)
    console.print(f"built builtin:{name}: held-out greedy accuracy {greedy:.3f}")
    return {
        **build_info(name, spec, model, losses),
        "held_out_count": HELD_OUT_EVAL,
        "held_out_greedy_accuracy": greedy,
        "held_out_sampled_accuracy": sampled,  # temperature 1.0, seed 0
        **({"held_out_greedy_first_integer_accuracy": first} if first is not None else {}),
    }


def save_greedy(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, folder: Path,
                max_new_tokens: int) -> None:
    """Save ``model`` into ``folder`` with a greedy generation config of the tokenizer's ids."""
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    with quiet_transformers_progress():
        model.save_pretrained(folder)


def build_info(name: str, spec: object, model: torch.nn.Module, losses: Sequence[float]
               ) -> dict[str, object]:
    """What every tiny build records: its name, spec, size, last loss, torch and CPU."""
    return {
        "name": name,
        "spec": attrs.asdict(spec),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "torch_version": torch.__version__,
        "cpu": cpu_description(),
    }
