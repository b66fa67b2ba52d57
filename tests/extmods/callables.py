"""Callables with known signatures for extension-loading tests."""

NOT_CALLABLE = 42


def two_kwargs(count: int = 10, name: str = "x") -> list[int]:
    return list(range(count))


def reward_fn(completions, items):
    return [0.0 for _ in completions]


class Outer:
    class Inner:
        @staticmethod
        def build() -> str:
            return "inner"


def raises() -> None:
    raise RuntimeError("factory exploded")
