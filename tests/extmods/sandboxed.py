"""Reward functions that misbehave in every way a sample can, for process isolation's tests:
each takes a one-element batch (as a worker calls it) and misbehaves only on completions that
ask it to, so the other samples of a batch score normally."""

from __future__ import annotations

import ctypes
import os
import time


def _value(text: str) -> float:
    return float(len(text))


def misbehaves(completions, items):
    """The completion names what to do: loop, sleep, bomb, exit, segv, fork, raise, nan, env;
    anything else scores its length."""
    out = []
    for text in completions:
        if text == "loop":
            while True:
                pass
        if text == "sleep":
            time.sleep(3600)
        if text == "bomb":
            hog = [bytearray(64 * 1024 * 1024) for _ in range(1024)]
            out.append(float(len(hog)))
            continue
        if text == "exit":
            os._exit(0)
        if text == "segv":
            ctypes.string_at(0)
        if text == "fork":
            if os.fork() == 0:
                time.sleep(3600)
                os._exit(0)
        if text == "raise":
            raise ValueError("no score for this one")
        if text == "nan":
            out.append(float("nan"))
            continue
        if text == "env":
            out.append(float(len([k for k in os.environ if "SECRET" in k])))
            continue
        if text == "cwd":
            with open("left-behind.txt", "w") as f:
                f.write("x")
            out.append(float(len(os.listdir("."))))
            continue
        out.append(_value(text))
    return out
