"""Each shipped tiny recipe's first two steps equal their pinned values (see
``tests/pinned_steps.py`` for what is pinned and how to regenerate it)."""

from __future__ import annotations

import json

import pytest

from tests.pinned_steps import PINNED, RECIPES, first_steps

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_first_steps_match_the_pinned_values(name):
    pinned = json.loads(PINNED.read_text())[name]
    got = first_steps(name)
    assert [sorted(r) for r in got] == [sorted(r) for r in pinned]
    for step, (g, p) in enumerate(zip(got, pinned, strict=True), start=1):
        for key in p:
            assert g[key] == pytest.approx(p[key], rel=1e-5, abs=1e-7), (step, key)
