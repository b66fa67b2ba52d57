"""A dataset factory that only rank 0 can build: the setup handshake must stop every rank with
one error naming the rank and role that failed."""

from __future__ import annotations

import os


def build_prompts(count: int = 32) -> list[dict[str, str]]:
    if os.environ.get("RANK") == "1":
        raise OSError("the data share is not mounted on this node")
    return [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(count)]
