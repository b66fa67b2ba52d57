"""The built-in calculator tools (``env.tools = ["runner.envs.calculator.add", ...]``)."""


def add(a: int, b: int) -> int:
    """Add two integers."""
    return int(a) + int(b)


def mul(a: int, b: int) -> int:
    """Multiply two integers."""
    return int(a) * int(b)
