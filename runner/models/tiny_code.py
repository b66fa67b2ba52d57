"""Build ``tiny-code``: a tiny Qwen2 model that writes the built-in code task's programs.

The warm-up is a supervised run on the training split of ``runner.data.code_task`` (prompt
through the chat template, then the program and eos; the loss on the program and eos only).
As with ``tiny-arith``, the model is given a habit that a test-running reward can train away:
a share of the warm-up programs of each kind (``CodeSpec.slips``) stop their loop one short
(``range(s, n)`` for ``range(s, n + 1)``). Where that share is over a half the greedy program
is mostly the wrong one, while sampling still writes the right one often enough for GRPO to
find it. Held-out problems are never trained on. The build records the shares of its held-out
programs (greedy and sampled) that are exactly the right one and exactly the one-short one; it
runs none of them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from transformers import (
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2ForCausalLM,
)

from runner.data.code_task import CodeProblem, problems
from runner.models.build_env import (
    deterministic_torch,
    warm_up_loop,
)
from runner.models.specs import CodeSpec
from runner.models.tiny import (
    build_info,
    generate_ids,
    model_config,
    padded_batch,
    prompt_ids,
    save_greedy,
)
from runner.models.tokenizer_build import build_tokenizer, save_tokenizer

MAX_PROGRAM_TOKENS = 40  # the longest program is 30 tokens, plus eos
HELD_OUT_EVAL = 64


def warm_up_examples(spec: CodeSpec) -> list[tuple[str, str]]:
    """(question, program) pairs, one batch after another, in a fixed order; a seeded share of
    each kind's programs (``spec.slips``) written one short."""
    slips = dict(spec.slips)
    train = problems("train", spec.steps * spec.batch_size, spec.seed)
    rng = random.Random(f"code-slip-{spec.seed}")
    return [(p.question, p.program(slip=rng.random() < slips.get(p.kind, 0.0))) for p in train]


def sft_batch(tokenizer: PreTrainedTokenizerBase, batch: Sequence[tuple[str, str]]
              ) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 off the program)."""
    return padded_batch(tokenizer, [
        (prompt_ids(tokenizer, q),
         tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id])
        for q, a in batch])


def write_programs(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase,
                   items: Sequence[CodeProblem], *, temperature: float = 0.0, seed: int = 0
                   ) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    prompts = [prompt_ids(tokenizer, p.question) for p in items]
    out = generate_ids(model, tokenizer, prompts, max_new_tokens=MAX_PROGRAM_TOKENS,
                       temperature=temperature, generator=generator)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in out]


def held_out_numbers(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase,
                     temperature: float = 0.0) -> dict[str, float]:
    """The shares of held-out programs that are exactly the right one and exactly the one-short
    one (compared as text: the build runs none of them; the tests of the shipped model run them
    with the ``code_tests`` reward)."""
    items = problems("held_out", HELD_OUT_EVAL)
    texts = write_programs(model, tokenizer, items, temperature=temperature)
    n = len(items)
    return {"exact_right": sum(t == p.program() for t, p in zip(texts, items, strict=True)) / n,
            "exact_one_short": sum(t == p.program(slip=True)
                                   for t, p in zip(texts, items, strict=True)) / n}


def build_tiny_code(folder: Path, name: str, spec: CodeSpec) -> dict[str, object]:
    """Write the complete model folder of ``spec`` into ``folder``; returns its build info."""
    console = Console(stderr=True)
    console.print(f"building builtin:{name} ...")
    with deterministic_torch():
        save_tokenizer(build_tokenizer(spec.tokenizer), spec.tokenizer, folder)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(model_config(spec, tokenizer))  # type: ignore[arg-type]
        examples = warm_up_examples(spec)
        size = spec.batch_size
        losses = warm_up_loop(
            model, lambda step: sft_batch(tokenizer, examples[step * size:(step + 1) * size]),
            spec.steps, spec.lr, name)
        greedy = held_out_numbers(model, tokenizer)
        sampled = held_out_numbers(model, tokenizer, temperature=1.0)
        save_greedy(model, tokenizer, folder, max_new_tokens=MAX_PROGRAM_TOKENS)
    console.print(f"built builtin:{name}: held-out greedy programs right "
                  f"{greedy['exact_right']:.3f}, one short {greedy['exact_one_short']:.3f}")
    return {
        **build_info(name, spec, model, losses),
        "held_out_count": HELD_OUT_EVAL,
        "held_out_greedy": greedy,
        "held_out_sampled": sampled,  # temperature 1.0, seed 0
    }
