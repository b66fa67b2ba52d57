"""The order of items in an epoch, and how ranks split it.

Both are pure functions over integer arrays: nothing here creates a Python object per item, so
ordering and sharding ten million items costs one numpy permutation and one strided view.

Remainder rule of ``shard``: rank ``r`` of ``w`` takes positions ``r, r + w, r + 2w, ...`` of
the order it is given. Every position goes to exactly one rank, and when ``len(order)`` is not a
multiple of ``w`` the first ``len(order) % w`` ranks take one item more than the others (shard
sizes differ by at most one). Nothing is dropped and nothing is repeated.
"""

from __future__ import annotations

import numpy as np

# Mixed into the seed so the data order never shares a random stream with anything else
# seeded from run.seed (sampling, initialisation).
_DATA_ORDER_DOMAIN = 0x6461_7461  # "data"


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The item indices of epoch ``epoch``, shape ``(n,)``, dtype int64.

    With ``shuffle`` this is a numpy ``Generator`` permutation seeded from ``(seed, epoch)``;
    without, it is ``0..n-1``. The result depends on nothing but the arguments.

    >>> epoch_order(4, seed=0, epoch=0, shuffle=False).tolist()
    [0, 1, 2, 3]
    >>> sorted(epoch_order(4, seed=0, epoch=3, shuffle=True).tolist())
    [0, 1, 2, 3]
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    # SeedSequence takes non-negative integers only; a negative run.seed maps to its
    # two's-complement value, which is still one distinct seed per run.seed.
    rng = np.random.default_rng([_DATA_ORDER_DOMAIN, seed % 2**64, epoch])
    return rng.permutation(n).astype(np.int64, copy=False)


def shard(order: np.ndarray, rank: int, world: int) -> np.ndarray:
    """The part of ``order`` that rank ``rank`` of ``world`` takes: ``order[rank::world]``.

    A view, not a copy. See the module docstring for the remainder rule.

    >>> shard(np.arange(7), rank=1, world=3).tolist()
    [1, 4]
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    return order[rank::world]
