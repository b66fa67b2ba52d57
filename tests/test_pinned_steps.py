"""Each shipped tiny recipe's first two steps equal their pinned values (see
``tests/pinned_steps.py`` for what is pinned and how to regenerate it).

Every machine trains the same shipped weights, so the pins hold on any x86-64 CPU up to the
last bits of its float kernels: AVX2, AVX-512 and the generic kernels sum in other orders. Those
moved the pinned values by up to 1.1e-5 relative (measured with the generic kernels below), so
they are compared at 1e-4; a change of the math moves them by far more.
"""

from __future__ import annotations

import json

import pytest

from tests.pinned_steps import PINNED, RECIPES, first_steps

pytestmark = pytest.mark.slow
REL, ABS = 1e-4, 1e-6
# torch's generic (non-vector) kernels, MKL without AVX and oneDNN without AVX: another
# summation order than this machine's, whatever CPU it is
OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                 "ONEDNN_MAX_CPU_ISA": "SSE41"}


def _assert_pinned(name: str, got: list[dict[str, float]]) -> None:
    pinned = json.loads(PINNED.read_text())[name]
    assert [sorted(r) for r in got] == [sorted(r) for r in pinned]
    for step, (g, p) in enumerate(zip(got, pinned, strict=True), start=1):
        for key in p:
            assert g[key] == pytest.approx(p[key], rel=REL, abs=ABS), (step, key)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_first_steps_match_the_pinned_values(name):
    _assert_pinned(name, first_steps(name))


@pytest.mark.parametrize("name", ["dpo-arith", "ppo-arith"])
def test_pins_hold_under_other_float_kernels(name, monkeypatch):
    """What another CPU does to the pins: the same recipe on other kernels stays within them
    (DPO's first gradient norm was 7.00 on one CPU and 4.60 on another while each machine
    built its own weights)."""
    for key, value in OTHER_KERNELS.items():
        monkeypatch.setenv(key, value)
    _assert_pinned(name, first_steps(name))
