"""Built-in and custom rewards, weighting, and the failures that name the callable."""

from __future__ import annotations

import doctest

import pytest

import runner.rewards.builtin as builtin
from runner.errors import RuntimeFailure
from runner.recipe.schema import RewardConfig
from runner.rewards import build_rewards
from runner.types import ObsBundle

ITEMS = [ObsBundle("What is 3 + 4?", "7"), ObsBundle("What is 5 - 9?", "-4")]


def test_doctests():
    assert doctest.testmod(builtin).failed == 0


def test_arithmetic_exact_parses_final_integer():
    assert builtin.arithmetic_exact(["7", "-4"], ITEMS) == [1.0, 1.0]
    assert builtin.arithmetic_exact(["3 + 4 = 7", "4"], ITEMS) == [1.0, 0.0]
    assert builtin.arithmetic_exact(["seven", ""], ITEMS) == [0.0, 0.0]


def test_weighted_sum_and_parts():
    rs = build_rewards(RewardConfig(functions=["arithmetic_exact", "format"], weights=[1.0, 0.5]))
    total, parts = rs.score(["7", "x -4"], ITEMS)
    assert total == [1.5, 1.0]
    assert parts == {"reward/arithmetic_exact": 1.0, "reward/format": 0.5}


def test_custom_dotted_reward():
    rs = build_rewards(RewardConfig(functions=["tests.extmods.callables.reward_fn"]))
    assert rs.score(["a", "b"], ITEMS)[0] == [0.0, 0.0]


def _bad_length(completions, items):
    return [1.0]


def _raises(completions, items):
    raise KeyError("missing field")


def _nan_at_1(completions, items):
    return [0.0, float("nan")]


@pytest.mark.parametrize("fn,text", [(_bad_length, "returned 1 values for 2 completions"),
                                     (_raises, "raised KeyError"),
                                     (_nan_at_1, "at index 1")])
def test_reward_failures_name_callable(monkeypatch, fn, text):
    import tests.extmods.callables as mod

    monkeypatch.setattr(mod, "bad", fn, raising=False)
    rs = build_rewards(RewardConfig(functions=["tests.extmods.callables.bad"]))
    with pytest.raises(RuntimeFailure) as info:
        rs.score(["a", "b"], ITEMS, step=3)
    assert "reward at step 3: tests.extmods.callables.bad" in str(info.value)
    assert text in str(info.value)
