"""Agents for the agent tests: each a plain function of (item, client, **kwargs), written as a
user would against the openai SDK, some of them breaking the contract on purpose."""

from __future__ import annotations

import time

ASK = "What is 21 + 77?"


def one_call(item, client, reward=None):
    """Asks once; returns ``reward`` (a number, a dict, or None)."""
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}])
    return reward


def rewrites(item, client):
    """Asks, then sends a history whose first message is edited."""
    first = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": ASK}]).choices[0].message
    client.chat.completions.create(model="m", messages=[
        {"role": "user", "content": ASK + " Think."}, first.model_dump(exclude_none=True),
        {"role": "user", "content": "Again."}])
    return 1.0


def follows_up(item, client):
    """Asks, then sends the answer back with a follow-up question (the append-only case)."""
    messages = [{"role": "user", "content": ASK}]
    first = client.chat.completions.create(model="m", messages=messages).choices[0].message
    messages += [first.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="m", messages=messages)
    return 0.5


def hangs(item, client):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}])
    time.sleep(3600)


def raises(item, client):
    raise RuntimeError("the agent gave up")


def never_asks(item, client):
    return 2.0


def wrong_key(item, client):
    from openai import OpenAI

    OpenAI(base_url=str(client.base_url), api_key="not-the-key", max_retries=0).models.list()


def paced(item, client, pause=0.0):
    """Three calls, each sending the conversation back with a follow-up; an item whose id is
    "slow" pauses ``pause`` seconds after each reply (an agent busy with its tools)."""
    messages = [{"role": "user", "content": str(item.prompt)}]
    for _ in range(3):
        choice = client.chat.completions.create(model="m", messages=messages).choices[0]
        if choice.finish_reason == "length":
            break
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Sure?"}]
        if item.id == "slow":
            time.sleep(pause)
    return 1.0
