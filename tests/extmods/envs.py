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
