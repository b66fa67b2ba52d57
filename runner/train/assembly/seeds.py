"""The run's seeds: the global generators seeded once per rank, and every other seed derived
from (run seed, step, purpose or position), so a resumed run draws what the uninterrupted one
drew and the same global batch samples alike on any number of ranks."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python's, NumPy's and torch's global generators; with ``deterministic`` torch warns
    where an operation has no deterministic kernel."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A seed for (run seed, step, purpose): the same whether or not the run was resumed.

    >>> step_seed(0, 1, salt=1)
    9177
    """
    return (seed * 1_000_003 + step * 9_176 + salt) % 2**31


def item_seed(seed: int, step: int, position: int) -> int:
    """The sampling seed of the item at global batch position ``position`` of ``step``: the
    same whatever the number of ranks."""
    return (step_seed(seed, step) * 1_000_033 + position * 7_777) % 2**63
