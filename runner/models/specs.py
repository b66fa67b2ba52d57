"""The shapes and warm-ups of the tiny text models (``runner.models.tiny`` builds them).

Plain data, no torch: the built-in table (``runner.models.builtin``) and the builders read it.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class TinySpec:
    """Shape and warm-up of one tiny arithmetic model (see ``runner.models.tiny``)."""

    tokenizer: str  # "bpe" | "char" (runner.models.tokenizer_build.SPECS)
    hidden_size: int
    num_layers: int
    steps: int  # supervised warm-up steps
    lr: float  # peak warm-up learning rate (linear warm-up, then linear decay to 0)
    batch_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    seed: int = 0
    warmup_hi: int = 20  # warm-up problems: the train split of operands 0..warmup_hi
    slip: float = 0.0  # share of warm-up answers written one too high (runner.models.tiny)
    restate: bool = False  # warm-up answers followed by the question: "14 (17 - 3)"


# Held-out greedy / sampled (T=1) accuracy on 200 problems, as the shipped builds measured them
# (their build_info.json), and build time on one thread of a 2-core CPU.
TINY_SPECS: dict[str, TinySpec] = {
    # 0.335 / 0.28, 50-90 s. GRPO (recipes/grpo-arith.toml) lifts held-out accuracy from 0.23 to
    # 0.5-0.6 within 20-60 steps; the same model without slip (0.31) did not move in 300 steps
    "tiny-arith": TinySpec(
        tokenizer="bpe", hidden_size=128, num_layers=3, steps=800, lr=3e-3, slip=0.65
    ),
    # one token per character, so answers are spelled digit by digit
    "tiny-arith-char": TinySpec(
        tokenizer="char", hidden_size=128, num_layers=3, steps=1500, lr=3e-3
    ),
    # the same tokenizer (same ids) as tiny-arith, bigger, no slip
    "tiny-arith-teacher": TinySpec(
        tokenizer="bpe", hidden_size=160, num_layers=4, steps=900, lr=3e-3
    ),
    # not taught the answer format: it answers, then restates the question ("14 (17 - 3)"),
    # so the last integer of its reply is not the answer; recipes/sft-arith.toml teaches it
    # the bare answer
    "tiny-arith-restate": TinySpec(
        tokenizer="bpe", hidden_size=128, num_layers=3, steps=800, lr=3e-3, restate=True
    ),
}


@attrs.frozen
class ToolsSpec:
    """Shape and warm-up of the multi-turn tool model (see ``runner.models.tiny_tools``).

    Per batch, a share ``arithmetic`` of calculator transcripts, the rest guess games. A
    calculator transcript is ``direct`` (an answer at once), ``call`` (the right tool call, its
    result copied) or a bad call (the rest: a wrong call, its wrong result copied); a guess game
    is ``sloppy`` (answers ignored) with probability ``sloppy``, else consistent with them.
    """

    steps: int  # supervised warm-up steps
    lr: float  # peak warm-up learning rate (linear warm-up, then linear decay to 0)
    hidden_size: int = 128
    num_layers: int = 3
    batch_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    seed: int = 0
    arithmetic: float = 0.5
    direct: float = 0.6
    call: float = 0.28
    sloppy: float = 0.45
    tokenizer: str = "tools"  # runner.models.tokenizer_build.SPECS


# Measured by the shipped build (build_info.json; 200 held-out problems, 200 games; greedy /
# sampled at T=1): held-out accuracy 0.04 / 0.28, correct first call 0.035 / 0.295, copy given
# a correct call 0.29 (7 calls) / 0.85, guess solved 0.47 / 0.46 in 4.6 / 4.9 turns (the warm-up
# games themselves: 0.67 in 4.5; bisection: always, at most 4); 6 min on one thread. 2-digit
# tool results are copied badly (most copy errors). The copy skill is fragile at this size:
# 2000 steps (same shares) copied 0.32, and arithmetic 0.8, direct 0.6, call 0.32 copied 0.66
# (sampled); with 3 layers (1800 steps, arithmetic 0.625, direct 0.65, call 0.27, true
# products as direct answers) 0.63, and greedy called on nearly every "*".
TOOLS_SPECS: dict[str, ToolsSpec] = {
    "tiny-arith-tools": ToolsSpec(
        steps=1900, lr=3e-3, num_layers=4, arithmetic=0.75, direct=0.65, call=0.27
    ),
}


@attrs.frozen
class CodeSpec:
    """Shape and warm-up of the tiny code model (see ``runner.models.tiny_code``): programs of
    the built-in code task, a share of each kind written with the loop one short (its *slip*)."""

    steps: int  # supervised warm-up steps
    lr: float  # peak warm-up learning rate (linear warm-up, then linear decay to 0)
    slips: tuple[tuple[str, float], ...]  # (kind, share of its programs written one short)
    hidden_size: int = 128
    num_layers: int = 3
    batch_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    seed: int = 0
    tokenizer: str = "code"  # runner.models.tokenizer_build.SPECS


CODE_SPECS: dict[str, CodeSpec] = {
    "tiny-code": CodeSpec(
        steps=800, lr=3e-3,
        slips=(("times", 0.65), ("square", 0.65), ("plus", 0.35), ("count", 0.35)),
    ),
}
