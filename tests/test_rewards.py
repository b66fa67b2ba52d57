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


# --- math_verify on real answers ---------------------------------------------------------------

GSM8K_REFERENCE = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                   "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
                   "#### 72")

# (reference, completion, expected reward): each line checked by hand.
MATH_CASES = [
    (GSM8K_REFERENCE, "She sold 24 in May, so 48 + 24 = 72 in total.\n#### 72", 1.0),
    (GSM8K_REFERENCE, "In May she sold 24 clips. #### 24", 0.0),  # the intermediate, not the answer
    (GSM8K_REFERENCE, r"The total is $\boxed{72}$.", 1.0),
    (GSM8K_REFERENCE, "The answer is 72.", 1.0),
    (GSM8K_REFERENCE, "I do not know.", 0.0),
    ("#### 1,000", "#### 1000", 1.0),  # thousands separator
    ("#### -3", "so the result is -3", 1.0),
    ("#### 0.5", r"$\frac{1}{2}$", 1.0),  # a fraction equals its decimal
    (r"$\frac{2}{3}$", "2/3", 1.0),
    (r"$\frac{2}{3}$", "0.67", 0.0),  # rounded is not equal
    (r"\boxed{\sqrt{2}}", r"The side is $\sqrt{2}$", 1.0),
    (r"\boxed{x^2 + 2x + 1}", r"$\boxed{(x+1)^2}$", 1.0),  # symbolic equality
    ("#### 18", "#### 81", 0.0),
]


@pytest.mark.parametrize("reference, completion, expected", MATH_CASES)
def test_math_verify_on_real_answers(reference, completion, expected):
    assert builtin.math_verify_reward([completion], [ObsBundle("q", reference)]) == [expected]


def test_the_recipe_names_every_builtin_reward_in_order():
    from runner.recipe.checks import BUILTIN_REWARDS

    assert tuple(builtin.BUILTIN_REWARDS) == BUILTIN_REWARDS


def test_math_verify_is_a_builtin_name_everywhere():
    from runner.recipe.checks import BUILTIN_REWARDS

    assert "math_verify" in BUILTIN_REWARDS
    rs = build_rewards(RewardConfig(functions=["math_verify"]))
    assert rs.score(["#### 72", "#### 7"], [ObsBundle("q", GSM8K_REFERENCE)] * 2)[0] == [1.0, 0.0]


# --- concurrency, time limits, the item a failure was on -----------------------------------------

def _set_of(monkeypatch, **fns):
    import tests.extmods.callables as mod

    for name, fn in fns.items():
        monkeypatch.setattr(mod, name, fn, raising=False)
    return build_rewards(RewardConfig(functions=[f"tests.extmods.callables.{n}" for n in fns],
                                      timeout_s=30.0))


def test_several_functions_run_concurrently(monkeypatch):
    import threading

    # Each waits for the other: run one after the other, the first would break the barrier.
    barrier = threading.Barrier(2, timeout=30)

    def meet(completions, items):
        barrier.wait()
        return [1.0] * len(completions)

    rs = _set_of(monkeypatch, first=lambda c, i: meet(c, i), second=lambda c, i: meet(c, i))
    total, parts = rs.score(["a", "b"], ITEMS)
    assert total == [2.0, 2.0]
    assert parts == {"reward/tests.extmods.callables.first": 1.0,
                     "reward/tests.extmods.callables.second": 1.0}


def test_a_reward_past_its_time_limit_is_named_with_its_item(monkeypatch):
    import threading

    from runner.errors import RewardFailure

    release = threading.Event()

    def stuck_on_second(completions, items):
        out = []
        for text, _item in zip(completions, items, strict=True):
            if text == "b":
                release.wait(60)
            out.append(0.0)
        return out

    import tests.extmods.callables as mod

    monkeypatch.setattr(mod, "slow", stuck_on_second, raising=False)
    rs = build_rewards(RewardConfig(functions=["arithmetic_exact", "tests.extmods.callables.slow"],
                                    timeout_s=0.2))
    try:
        with pytest.raises(RewardFailure) as info:
            rs.score(["7", "b"], ITEMS, step=5)
    finally:
        release.set()
    assert info.value.failures == ((
        "tests.extmods.callables.slow", 1, "did not finish within reward.timeout_s = 0.2 s, "
        "at item 1 of 2 (the last item it read); its thread is abandoned"),)
    assert str(info.value).startswith("reward at step 5: tests.extmods.callables.slow did not")
    assert isinstance(info.value, RuntimeFailure)


def test_an_exception_names_the_callable_and_the_item_and_every_failure_is_reported(monkeypatch):
    from runner.errors import RewardFailure

    def fails_on_second(completions, items):
        return [float(len(items[k].reference) // (k - 1)) for k in range(len(items))]

    rs = _set_of(monkeypatch, divides=fails_on_second, short=lambda c, i: [1.0])
    with pytest.raises(RewardFailure) as info:
        rs.score(["a", "b"], ITEMS, step=2)
    (name1, at1, what1), (name2, at2, what2) = info.value.failures
    assert (name1, at1) == ("tests.extmods.callables.divides", 1)
    assert what1 == ("raised ZeroDivisionError: integer division or modulo by zero at item 1 of 2 "
                     "(the last item it read)")
    assert (name2, at2, what2) == ("tests.extmods.callables.short", None,
                                   "returned 1 values for 2 completions")


def test_one_function_without_a_limit_runs_in_the_calling_thread(monkeypatch):
    import threading

    seen = []

    def where(completions, items):
        seen.append(threading.current_thread() is threading.main_thread())
        return [0.0] * len(completions)

    import tests.extmods.callables as mod

    monkeypatch.setattr(mod, "where", where, raising=False)
    for timeout_s in (0.0, 5.0):
        build_rewards(RewardConfig(functions=["tests.extmods.callables.where"],
                                   timeout_s=timeout_s)).score(["a"], ITEMS[:1])
    assert seen == [True, False]


def test_weighted_totals_and_means_per_function():
    """What the held-out metrics sum over ranks: each completion's weighted total and each
    function's mean."""
    rs = build_rewards(RewardConfig(functions=["arithmetic_exact", "format"], weights=[1.0, 0.5]))
    total, parts = rs.score(["7", "x -4"], ITEMS)
    assert sum(total) / len(total) == 1.25
    assert parts == {"reward/arithmetic_exact": 1.0, "reward/format": 0.5}
