"""An example environment module: guess the hidden number, told "higher" or "lower" each turn.

Name it in a recipe (run from the repository root, so ``examples`` is importable)::

    [data]
    factory = "examples.guess_env.guess_games"
    factory_kwargs = { count = 2000 }
    response_column = "answer"

    [env]
    factory = "examples.guess_env.build_env"
    factory_kwargs = { low = 1, high = 16 }
    max_turns = 6

Each item is one game: its prompt asks for a number in [low, high] and its answer holds the
hidden number. Every wrong guess costs 0.1 and the right one earns 1, so an episode's env reward
is 1 - 0.1 x (wrong guesses) when the number is found, and -0.1 x (turns) when it is not: the
policy is paid for finding it in fewer turns. ``info`` logs ``found`` and ``wrong_format``.
"""

from __future__ import annotations

import random
import re

from runner.envs import EnvStep
from runner.types import ObsBundle

FIRST_INTEGER = re.compile(r"-?\d+")


class GuessEnv:
    """One game per episode (the runner calls the factory once per episode)."""

    def __init__(self, low: int = 1, high: int = 16) -> None:
        self.low, self.high = low, high
        self.target = low

    def reset(self, item: ObsBundle, seed: int) -> list[dict[str, str]]:
        self.target = int(item.reference)
        return [{"role": "user", "content": str(item.prompt)}]

    def step(self, messages: list[dict[str, str]]) -> EnvStep:
        match = FIRST_INTEGER.search(messages[-1]["content"])
        if match is None:
            return EnvStep([{"role": "user", "content": "Answer with a number."}], reward=-0.1,
                           info={"wrong_format": 1.0})
        guess = int(match.group())
        if guess == self.target:
            return EnvStep(reward=1.0, done=True, info={"found": 1.0})
        hint = "higher" if self.target > guess else "lower"
        return EnvStep([{"role": "user", "content": hint}], reward=-0.1)


def build_env(low: int = 1, high: int = 16) -> GuessEnv:
    return GuessEnv(low, high)


class GuessGames:
    """Rows ``{"prompt": "Guess my number from 1 to 16.", "answer": "11"}``: the hidden number
    of game i is drawn from (split, i), so training and held-out games differ by id."""

    def __init__(self, count: int, low: int, high: int, split: str) -> None:
        self.count, self.low, self.high, self.split = count, low, high, split

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, str]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        target = random.Random(f"{self.split}-{index}").randint(self.low, self.high)
        return {"prompt": f"Guess my number from {self.low} to {self.high}.",
                "answer": str(target)}

    def cursor_fingerprint(self) -> str:
        return f"guess-games-v1 {self.split} {self.count} {self.low}-{self.high}"

    def membership_ids(self) -> tuple[str, ...]:
        return tuple(f"guess-{self.split}-{i}" for i in range(self.count))


def guess_games(count: int = 2000, low: int = 1, high: int = 16) -> GuessGames:
    """Training games."""
    return GuessGames(count, low, high, "train")


def held_out_guess_games(count: int = 64, low: int = 1, high: int = 16) -> GuessGames:
    """Held-out games (other ids, other draws)."""
    return GuessGames(count, low, high, "held-out")
