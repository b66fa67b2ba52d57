"""An agent as anyone writes one against the OpenAI API: a loop over chat completions with two
calculator tools, run by the runner once per episode (``[env] agent`` in
``recipes/grpo-openai-agent.toml``) with a client of the policy it trains.

Nothing here knows the runner: the same function runs against any OpenAI-compatible endpoint.
"""

from __future__ import annotations

import json

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}} for name in ("add", "mul")]


def _run(name: str, arguments: dict) -> str:
    try:
        a, b = int(arguments["a"]), int(arguments["b"])
    except (KeyError, TypeError, ValueError):
        return "error: give integers a and b"
    return str(a + b if name == "add" else a * b if name == "mul" else "unknown tool")


def solve(item, client, model: str = "policy", max_steps: int = 3):
    """Answer the item's question, calling the tools as the model asks; None: the recipe's
    reward functions score the last reply."""
    messages = [{"role": "user", "content": str(item.prompt)}]
    for _ in range(max_steps):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            result = _run(call.function.name, json.loads(call.function.arguments or "{}"))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
