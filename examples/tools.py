"""An example tool module: plain Python functions offered to the model as tools.

Name them in a recipe's ``[env]`` (run from the repository root)::

    [env]
    tools = ["examples.tools.sub", "examples.tools.divide", "examples.tools.unit_price"]
    tool_timeout_s = 2.0

Each function's name, the first paragraph of its docstring and its annotated parameters become
the tool's description in the chat template. The model calls a tool by writing
``<tool_call>{"name": "divide", "arguments": {"a": 7, "b": 2}}</tool_call>``; the result is
returned as a ``tool`` message. An exception (``divide`` by zero, an unknown item) or a call
slower than ``env.tool_timeout_s`` becomes a tool message that says so, and the episode goes on.
"""

from __future__ import annotations

PRICES = {"apple": 0.5, "bread": 2.25, "milk": 1.1}


def sub(a: int, b: int) -> int:
    """Subtract b from a."""
    return a - b


def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


def unit_price(item: str) -> float:
    """The price of one unit of an item in the shop (apple, bread, milk)."""
    return PRICES[item]
