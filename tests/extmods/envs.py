"""Environments and tools for the [env] tests."""

import time

from runner.envs import EnvStep


class Retry:
    """Answers a wrong reply with "Wrong, try again."; a right one ends the episode (reward 1)."""

    def reset(self, item, seed):
        self.answer = item.reference
        return [{"role": "user", "content": item.prompt}]

    def step(self, messages):
        if messages[-1]["content"].strip() == self.answer:
            return EnvStep(reward=1.0, done=True, info={"solved": 1.0})
        return EnvStep(messages=[{"role": "user", "content": "Wrong, try again."}],
                       reward=-0.25)


def retry(penalty: float = 0.25):
    return Retry()


class _StepReturns(Retry):
    def __init__(self, value):
        self.value = value

    def step(self, messages):
        return self.value


def returns_dict():
    return _StepReturns({"done": True})


def returns_bad_role():
    return _StepReturns(EnvStep(messages=[{"role": "assistant", "content": "x"}]))


class _Raises(Retry):
    def step(self, messages):
        raise KeyError("no such door")


def raises_in_step():
    return _Raises()


class _Hangs(Retry):
    def step(self, messages):
        time.sleep(30)


def hangs_in_step():
    return _Hangs()


def not_an_env():
    return 42


def mul(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def sleepy(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "awake"


def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


class _ToolAnswer(Retry):
    def step(self, messages):
        return EnvStep(messages=[{"role": "tool", "content": "42"}])


def answers_as_tool():
    return _ToolAnswer()


# --- hostile tools and environments ---------------------------------------------------------

class _NoText:
    def __str__(self):
        raise ValueError("no text for you")

    __repr__ = __str__


def unprintable() -> str:
    """A result whose str() raises."""
    return _NoText()


def deep() -> str:
    """A list nested beyond the recursion limit."""
    value: list = []
    for _ in range(100_000):
        value = [value]
    return value


def surrogate() -> str:
    """A string with a lone surrogate."""
    return "x\ud800y"


class _Unspeakable(Exception):
    def __str__(self):
        raise RuntimeError("cannot say")


def raises_unprintable() -> str:
    """Raises an exception whose str() raises."""
    raise _Unspeakable()


def huge(n: int) -> str:
    """n characters."""
    return "7" * n


class _Steps(Retry):
    """Answers every turn with the next of ``steps``."""

    def __init__(self, *steps):
        self.steps = list(steps)

    def step(self, messages):
        return self.steps.pop(0)


AGAIN = [{"role": "user", "content": "Again."}]


def done_is_a_string():
    return _Steps(EnvStep(done="no"))


def info_names_turns():
    return _Steps(EnvStep(info={"turns": 9.0}))


def info_not_a_dict():
    return _Steps(EnvStep(info=[("solved", 1.0)]))


def info_too_big():
    return _Steps(EnvStep(info={"score": 10**400}))


def reward_beyond_float32():
    return _Steps(EnvStep(reward=1e308, done=True))


def rewards_that_add_up():
    return _Steps(EnvStep(messages=AGAIN, reward=9e14), EnvStep(reward=9e14, done=True))


def huge_answer():
    return _Steps(EnvStep(messages=[{"role": "user", "content": "7" * 50_000_000}]))


def done_as_numpy():
    import numpy as np

    return _Steps(EnvStep(reward=np.float32(0.5), done=np.bool_(True), info={"found": np.int64(1)}))


class _Exits(Retry):
    """Leaves the process with ``os._exit(code)`` in its first step, on rank ``rank`` alone
    (None: on every rank)."""

    def __init__(self, code, rank):
        self.code, self.rank = code, rank

    def step(self, messages):
        import os

        if self.rank is None or os.environ.get("RANK", "0") == str(self.rank):
            os._exit(self.code)
        return super().step(messages)


def exits_in_step(code: int = 0, rank: int | None = None):
    return _Exits(code, rank)
