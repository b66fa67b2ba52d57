"""Build ``tiny-arith-tools``: a tiny Qwen2 model warmed up on multi-turn tool and game transcripts.

The model is a starting point for multi-turn RL, with two tasks whose reward a policy can raise
by changing *what it does*, not by learning new skills in minutes:

1. **Calculator.** ``What is 47 * 86?`` (operands 10..99, ``+`` and ``*``) with the tools
   ``add(a, b)`` and ``mul(a, b)``. The warm-up shows three behaviours, drawn per example:
   *direct* (answer at once, no tool), *call* (the right tool call, the tool's result, the result
   copied) and *bad call* (one digit of one argument changed, or the wrong tool; the wrong
   result, copied). Direct is the most frequent, so the greedy first move is mostly a direct
   answer and greedy accuracy starts low, while sampling calls the tool correctly in a fair share
   of episodes and then copies the result: RL that rewards the right answer teaches "call the
   tool, with the question's numbers".

   What a direct answer says, and why: for ``+`` the true sum (the model learns a fuzzy
   addition). For ``*`` the true product was tried first: a tiny model cannot multiply two
   2-digit numbers, so its first answer digit stays uncertain, the one ``<tool_call>`` token
   outweighs it and the *greedy* first move on ``*`` was a call (greedy accuracy then starts
   high). So a direct ``*`` answer is a rough estimate with the units cut, ``47 * 86 -> 3200``
   (:func:`direct_answer`): a 9 x 9 table the model learns with a confident first digit, so
   greedy answers directly (and wrongly), while sampling still calls the tool at the call share.
2. **Guess the number** from 1 to 16: each assistant turn is a bare number, the user answers
   ``higher`` or ``lower`` until the guess is right, at most ``GUESS_MAX_TURNS`` turns. A share of
   the warm-up games is *sloppy* (random new numbers, the answers ignored), the others guess at
   random within the interval the answers still allow; bisection needs at most 4 turns, so RL
   that rewards solving in fewer turns has room to act.

The loss is on the assistant turns only (each with its closing eos). The transcript generators
are plain functions of a seeded ``random.Random`` (reused by tests and environments); the
evaluator plays whole episodes with the model, executing its tool calls, and the build records
what it measured in ``build_info.json``. The build is deterministic on one machine
(``runner.models.build_env``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import attrs

from runner.data.arithmetic import Problem, problems
from runner.models.build_env import (
    deterministic_torch,
    warm_up_loop,
)
from runner.models.specs import TOOLS_SPECS, ToolsSpec
from runner.models.transcripts import (
    ARITH_TASK,
    EVAL_EPISODES,
    GUESS_HI,
    GUESS_MAX_TURNS,
    GUESS_PROMPT,
    MAX_ARITH_TURNS,
    MAX_TURN_TOKENS,
    OP_TOOL,
    TOOLS,
    Conversation,
    guess_reply,
    parse_tool_call,
    run_tool,
    tools_header,
    warm_up_conversations,
)

# --- the warm-up ------------------------------------------------------------------------------


def message_text(message: dict[str, str], eos: str = "<|eos|>") -> str:
    """One message as the ``tools`` chat template renders it."""
    role, content = message["role"], message["content"]
    if role == "tool":
        return f"<|user|><tool_response>{content}</tool_response>{eos}"
    if role not in ("system", "user", "assistant"):
        raise ValueError(f"roles must be system, user, assistant or tool, got {role!r}")
    return f"<|{role}|>{content}{eos}"


def conversation_ids(tokenizer, conv: Conversation) -> tuple[list[int], list[int]]:
    """Token ids of ``conv`` as the chat template renders them, and labels: each assistant
    turn's content and closing eos, -100 elsewhere. Encoded message by message (every message
    starts and ends with a special token, so the pieces tokenize as the whole does)."""
    ids, labels = [tokenizer.bos_token_id], [-100]
    if conv.tools:
        piece = tokenizer.encode(f"<|system|>{tools_header(conv.tools)}<|eos|>",
                                 add_special_tokens=False)
        ids += piece
        labels += [-100] * len(piece)
    for message in conv.messages:
        piece = tokenizer.encode(message_text(message), add_special_tokens=False)
        ids += piece
        if message["role"] == "assistant":
            labels += [-100] + piece[1:]
        else:
            labels += [-100] * len(piece)
    return ids, labels


def sft_batch(tokenizer, rows: Sequence[tuple[list[int], list[int]]]) -> dict[str, object]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels``, [B, T]."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids))
                                        for ids, _ in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows]),
    }


# --- playing episodes -------------------------------------------------------------------------


def generate_turns(model, tokenizer, prompts: Sequence[list[int]], *, temperature: float,
                   generator, max_new_tokens: int = MAX_TURN_TOKENS) -> list[str]:
    """One assistant turn per prompt (greedy when ``temperature`` is 0), decoded up to eos with
    ``skip_special_tokens=True`` (the tool markers stay): ``runner.models.tiny.generate_ids``."""
    from runner.models.tiny import generate_ids

    out = generate_ids(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                       temperature=temperature, generator=generator)
    return [tokenizer.decode(toks, skip_special_tokens=True) for toks in out]


def _prompt(tokenizer, messages, tools) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        add_generation_prompt=True)
    return list(out["input_ids"])


@attrs.frozen
class ArithmeticEpisode:
    problem: Problem
    messages: list[dict[str, str]]

    @property
    def first_call(self) -> tuple[str, int, int] | None:
        return parse_tool_call(self.messages[1]["content"])

    @property
    def called_correctly(self) -> bool:
        p = self.problem
        return self.first_call == (OP_TOOL[p.op], p.a, p.b)

    @property
    def final_answer(self) -> str | None:
        """The last assistant turn when it is not a tool call (None: the episode ran out)."""
        last = self.messages[-1]
        if last["role"] != "assistant" or "<tool_call>" in last["content"]:
            return None
        return last["content"].strip()

    @property
    def correct(self) -> bool:
        return self.final_answer == str(self.problem.answer)


def play_arithmetic(model, tokenizer, items: Sequence[Problem], *, temperature: float = 0.0,
                    seed: int = 0) -> list[ArithmeticEpisode]:
    """Play each problem: the model's tool calls are executed (a malformed one gets ``error``)
    until it answers without a call, or after ``MAX_ARITH_TURNS`` assistant turns."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    convs = [[{"role": "user", "content": p.question}] for p in items]
    active = list(range(len(items)))
    for _ in range(MAX_ARITH_TURNS):
        if not active:
            break
        texts = generate_turns(model, tokenizer, [_prompt(tokenizer, convs[i], TOOLS)
                                                  for i in active],
                               temperature=temperature, generator=generator)
        still = []
        for i, text in zip(active, texts, strict=True):
            convs[i].append({"role": "assistant", "content": text})
            if "<tool_call>" in text:
                call = parse_tool_call(text)
                convs[i].append({"role": "tool",
                                 "content": str(run_tool(*call)) if call else "error"})
                still.append(i)
        active = still
    return [ArithmeticEpisode(p, c) for p, c in zip(items, convs, strict=True)]


def play_guess(model, tokenizer, targets: Sequence[int], *, temperature: float = 0.0,
               seed: int = 0) -> list[tuple[bool, int]]:
    """Play each game: ``(solved, assistant turns)``. A turn that is not a number in range ends
    the game unsolved; so do ``GUESS_MAX_TURNS`` wrong guesses."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    convs = [[{"role": "user", "content": GUESS_PROMPT}] for _ in targets]
    result: list[tuple[bool, int]] = [(False, GUESS_MAX_TURNS)] * len(targets)
    active = list(range(len(targets)))
    for turn in range(1, GUESS_MAX_TURNS + 1):
        if not active:
            break
        texts = generate_turns(model, tokenizer, [_prompt(tokenizer, convs[i], None)
                                                  for i in active],
                               temperature=temperature, generator=generator, max_new_tokens=4)
        still = []
        for i, text in zip(active, texts, strict=True):
            convs[i].append({"role": "assistant", "content": text})
            guess = int(text) if text.strip().isdigit() else None
            if guess is None or not 1 <= guess <= GUESS_HI:
                result[i] = (False, turn)
                continue
            reply = guess_reply(targets[i], guess)
            if reply is None:
                result[i] = (True, turn)
            elif turn < GUESS_MAX_TURNS:
                convs[i].append({"role": "user", "content": reply})
                still.append(i)
        active = still
    return result


def guess_targets(count: int = EVAL_EPISODES, seed: int = 0) -> list[int]:
    rng = random.Random(f"guess-eval-{seed}")
    return [rng.randint(1, GUESS_HI) for _ in range(count)]


def evaluate(model, tokenizer, count: int = EVAL_EPISODES) -> dict[str, float]:
    """Held-out calculator episodes and guess games, greedy and sampled (T=1, seed 0)."""
    items = problems("held_out", count, *ARITH_TASK)
    targets = guess_targets(count)
    out: dict[str, float] = {}
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        episodes = play_arithmetic(model, tokenizer, items, temperature=temperature)
        called = [e for e in episodes if e.called_correctly]
        out[f"held_out_{mode}_accuracy"] = sum(e.correct for e in episodes) / count
        out[f"{mode}_correct_call_share"] = len(called) / count
        out[f"{mode}_any_call_share"] = sum("<tool_call>" in e.messages[1]["content"]
                                            for e in episodes) / count
        out[f"{mode}_copy_accuracy"] = (sum(e.correct for e in called) / len(called)
                                        if called else 0.0)
        direct = [e for e in episodes if "<tool_call>" not in e.messages[1]["content"]]
        out[f"{mode}_direct_accuracy"] = (sum(e.correct for e in direct) / len(direct)
                                          if direct else 0.0)
        games = play_guess(model, tokenizer, targets, temperature=temperature)
        out[f"guess_{mode}_solved_share"] = sum(s for s, _ in games) / count
        out[f"guess_{mode}_mean_turns"] = sum(t for _, t in games) / count
    return {k: round(v, 4) for k, v in out.items()}


def warm_up_policy_numbers(conversations: Sequence[Conversation]) -> dict[str, float]:
    """The warm-up data's own guess policy: solved share and mean turns per game (what RL should
    beat), and the calculator behaviours' shares."""
    games = [c for c in conversations if c.target is not None]
    solved = [c.messages[-1]["content"] == str(c.target) for c in games]
    turns = [sum(m["role"] == "assistant" for m in c.messages) for c in games]
    arith = [c for c in conversations if c.tools]
    calls = [c for c in arith if len(c.messages) > 2]
    return {"warm_up_guess_solved_share": round(sum(solved) / len(games), 4),
            "warm_up_guess_mean_turns": round(sum(turns) / len(games), 4),
            "warm_up_call_share": round(len(calls) / len(arith), 4)}


# --- the build --------------------------------------------------------------------------------


def warm_up(model, tokenizer, spec: ToolsSpec, label: str) -> list[float]:
    """The supervised warm-up (``build_env.warm_up_loop``) on ``warm_up_conversations(spec)``."""
    rows = [conversation_ids(tokenizer, c) for c in warm_up_conversations(spec)]
    size = spec.batch_size
    return warm_up_loop(
        model, lambda step: sft_batch(tokenizer, rows[step * size : (step + 1) * size]),
        spec.steps, spec.lr, label,
    )


def _check_template(tokenizer, conversations: Sequence[Conversation]) -> None:
    """The message-by-message ids equal the chat template's (guards the warm-up's encoding)."""
    for conv in conversations:
        rendered = tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=True)
        if list(rendered["input_ids"]) != conversation_ids(tokenizer, conv)[0]:
            raise AssertionError(f"the warm-up encodes {conv.messages} unlike the chat template")


def build_tiny_tools(folder: Path, name: str) -> dict[str, object]:
    """Write the complete model folder of ``TOOLS_SPECS[name]`` into ``folder``; returns its
    build info with the evaluator's numbers."""
    import torch
    from rich.console import Console
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from runner.models.tiny import build_info, model_config, save_greedy
    from runner.models.tokenizer_build import build_tokenizer, save_tokenizer

    spec = TOOLS_SPECS[name]
    console = Console(stderr=True)
    console.print(f"building builtin:{name} ...")
    with deterministic_torch():
        save_tokenizer(build_tokenizer(spec.tokenizer), spec.tokenizer, folder)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        conversations = warm_up_conversations(spec)
        _check_template(tokenizer, conversations[: 2 * spec.batch_size])
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(model_config(spec, tokenizer))
        losses = warm_up(model, tokenizer, spec, name)
        measured = evaluate(model, tokenizer)
        save_greedy(model, tokenizer, folder, max_new_tokens=MAX_TURN_TOKENS)
    console.print(summary(name, measured))
    return {
        **build_info(name, spec, model, losses),
        "held_out_count": EVAL_EPISODES,
        "guess_games": EVAL_EPISODES,
        **measured,  # sampled: temperature 1.0, seed 0
        **warm_up_policy_numbers(conversations),
    }


def summary(name: str, m: dict[str, float]) -> str:
    """One line: held-out accuracy, correct calls and copies, guess games (greedy / sampled)."""
    def pair(key: str, digits: int = 3) -> str:
        return f"{m[key.format('greedy')]:.{digits}f} / {m[key.format('sampled')]:.{digits}f}"

    return (f"built builtin:{name}: held-out accuracy {pair('held_out_{}_accuracy')}, "
            f"correct call {pair('{}_correct_call_share')}, copy {pair('{}_copy_accuracy')}, "
            f"guess solved {pair('guess_{}_solved_share')} in {pair('guess_{}_mean_turns', 2)} "
            "turns (greedy / sampled)")
