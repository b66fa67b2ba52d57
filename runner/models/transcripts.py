"""The tool model's transcripts: calculator and guess-the-number conversations, the tools'
schemas and call syntax, and the tokenizer's corpus. Plain functions of a seeded
``random.Random``, with no torch: the tokenizer build (``runner.models.tokenizer_build``), the
model build (``runner.models.tiny_tools``), environments and tests all read them."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

import attrs

from runner.data.arithmetic import Problem, problems
from runner.models.specs import TOOLS_SPECS, ToolsSpec

ARITH_TASK = (10, 99, ("+", "*"))  # operands 10..99, + and *
OP_TOOL = {"+": "add", "*": "mul"}
TOOL_FUNCTIONS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}
MAX_ARITH_TURNS = 3  # assistant turns of one calculator episode when playing
GUESS_HI = 16
GUESS_PROMPT = f"Guess my number from 1 to {GUESS_HI}."
GUESS_MAX_TURNS = 6
EVAL_EPISODES = 200  # held-out problems and games played after the warm-up
MAX_TURN_TOKENS = 32  # a tool call is ~20 tokens with its markers


def tool_schema(name: str, description: str) -> dict[str, object]:
    """An OpenAI-style function schema with two integer parameters ``a`` and ``b``."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


TOOLS = [tool_schema("add", "a + b"), tool_schema("mul", "a * b")]


# --- transcripts (pure functions) -------------------------------------------------------------


def tool_call_text(name: str, a: int, b: int) -> str:
    """The assistant content of a tool call turn, e.g.
    ``<tool_call>{"name": "mul", "arguments": {"a": 47, "b": 86}}</tool_call>``."""
    call = json.dumps({"name": name, "arguments": {"a": a, "b": b}})
    return f"<tool_call>{call}</tool_call>"


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_call(text: str) -> tuple[str, int, int] | None:
    """``(name, a, b)`` of a well-formed call of a known tool in ``text``; None otherwise."""
    match = _CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
        name, args = call["name"], call["arguments"]
        a, b = args["a"], args["b"]
    except (ValueError, TypeError, KeyError):
        return None
    if name not in TOOL_FUNCTIONS or type(a) is not int or type(b) is not int:
        return None
    return name, a, b


def run_tool(name: str, a: int, b: int) -> int:
    return TOOL_FUNCTIONS[name](a, b)


def call_transcript(problem: Problem, name: str | None = None, a: int | None = None,
                    b: int | None = None) -> list[dict[str, str]]:
    """Question, tool call, the tool's result, the result copied; the right call by default."""
    name = name or OP_TOOL[problem.op]
    a, b = problem.a if a is None else a, problem.b if b is None else b
    result = str(run_tool(name, a, b))
    return [
        {"role": "user", "content": problem.question},
        {"role": "assistant", "content": tool_call_text(name, a, b)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


def bad_call_transcript(problem: Problem, rng: random.Random) -> list[dict[str, str]]:
    """A wrong call (a quarter: the other tool; else one digit of one argument changed, still a
    2-digit number), its result, copied."""
    if rng.random() < 0.25:
        return call_transcript(problem, name=OP_TOOL["*" if problem.op == "+" else "+"])
    args = [problem.a, problem.b]
    which, position = rng.randrange(2), rng.randrange(2)
    digits = list(str(args[which]))
    choices = [d for d in "0123456789"[position == 0:] if d != digits[position]]
    digits[position] = rng.choice(choices)
    args[which] = int("".join(digits))
    return call_transcript(problem, a=args[0], b=args[1])


def direct_answer(problem: Problem) -> int:
    """The warm-up's answer without the tool: the true sum for ``+``; for ``*`` the product of
    the operands with their units cut (47 * 86 -> 40 * 80 = 3200), a rough estimate."""
    if problem.op == "+":
        return problem.answer
    return (problem.a // 10 * 10) * (problem.b // 10 * 10)


def direct_transcript(problem: Problem) -> list[dict[str, str]]:
    """Question and :func:`direct_answer` at once, no tool."""
    return [{"role": "user", "content": problem.question},
            {"role": "assistant", "content": str(direct_answer(problem))}]


def arithmetic_transcript(problem: Problem, behaviour: str,
                          rng: random.Random) -> list[dict[str, str]]:
    """The messages of ``behaviour`` ("direct", "call" or "bad call"); render with ``TOOLS``."""
    if behaviour == "direct":
        return direct_transcript(problem)
    if behaviour == "call":
        return call_transcript(problem)
    if behaviour == "bad call":
        return bad_call_transcript(problem, rng)
    raise ValueError(f"unknown behaviour {behaviour!r}")


def guess_reply(target: int, guess: int) -> str | None:
    """The environment's answer: ``higher`` (target above), ``lower``, or None when right."""
    return None if guess == target else ("higher" if target > guess else "lower")


def guess_transcript(target: int, sloppy: bool, rng: random.Random) -> list[dict[str, str]]:
    """One warm-up game (no tools block). Consistent: uniform within the interval the answers
    still allow; sloppy: uniform among the numbers not yet guessed, answers ignored. Ends at the
    right guess or after ``GUESS_MAX_TURNS`` guesses (no reply after the last)."""
    messages = [{"role": "user", "content": GUESS_PROMPT}]
    lo, hi, guessed = 1, GUESS_HI, set()
    for turn in range(GUESS_MAX_TURNS):
        if sloppy:
            guess = rng.choice([n for n in range(1, GUESS_HI + 1) if n not in guessed])
        else:
            guess = rng.randint(lo, hi)
        guessed.add(guess)
        messages.append({"role": "assistant", "content": str(guess)})
        reply = guess_reply(target, guess)
        if reply is None or turn == GUESS_MAX_TURNS - 1:
            break
        messages.append({"role": "user", "content": reply})
        lo, hi = (max(lo, guess + 1), hi) if reply == "higher" else (lo, min(hi, guess - 1))
    return messages


@attrs.frozen
class Conversation:
    """Messages, the tools block they are rendered with (None: no tools block), and the hidden
    number of a guess game (None: a calculator transcript)."""

    messages: list[dict[str, str]]
    tools: list[dict[str, object]] | None
    target: int | None = None


def warm_up_conversations(spec: ToolsSpec, count: int | None = None) -> list[Conversation]:
    """The warm-up in a fixed order: per batch, first ``round(batch_size * spec.arithmetic)``
    calculator transcripts (train split only), then guess games; ``count`` batches' worth
    (default: all steps)."""
    steps = spec.steps if count is None else count
    half = round(spec.batch_size * spec.arithmetic)
    train = problems("train", steps * half, *ARITH_TASK, seed=spec.seed)
    arith_rng = random.Random(f"tools-arith-{spec.seed}")
    guess_rng = random.Random(f"tools-guess-{spec.seed}")
    out: list[Conversation] = []
    for step in range(steps):
        for p in train[step * half : (step + 1) * half]:
            u = arith_rng.random()
            behaviour = ("direct" if u < spec.direct
                         else "call" if u < spec.direct + spec.call else "bad call")
            out.append(Conversation(arithmetic_transcript(p, behaviour, arith_rng), TOOLS))
        for _ in range(spec.batch_size - half):
            target = guess_rng.randint(1, GUESS_HI)
            sloppy = guess_rng.random() < spec.sloppy
            out.append(Conversation(guess_transcript(target, sloppy, guess_rng), None, target))
    return out


def tools_header(tools: Sequence[dict[str, object]]) -> str:
    """``tools: add(a, b), mul(a, b)``: the system turn's text, as the chat template writes it."""
    parts = [f"{t['function']['name']}({', '.join(t['function']['parameters']['properties'])})"
             for t in tools]
    return "tools: " + ", ".join(parts)


def corpus_texts() -> list[str]:
    """The tokenizer's training text: every kind of message content of the warm-up, in order."""
    spec = attrs.evolve(TOOLS_SPECS["tiny-arith-tools"], direct=0.34, call=0.33)
    texts = [tools_header(TOOLS), GUESS_PROMPT, "higher", "lower"]
    for conv in warm_up_conversations(spec, count=100):
        texts += [tools_header(conv.tools)] if conv.tools else []
        texts += [m["content"] for m in conv.messages]
    return texts
