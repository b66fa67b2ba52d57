"""The order of items in an epoch, and how ranks split it.

Both are pure functions over integer arrays: nothing here creates a Python object per item, so
ordering and sharding ten million items costs a few linear numpy passes and one strided view.

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

    With ``shuffle`` this is a uniformly random permutation drawn by a numpy ``Generator``
    seeded from ``(seed, epoch)`` (bucketed for large ``n``, see ``_bucketed_permutation``);
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
    if n < _BUCKETED_FROM:
        return rng.permutation(n).astype(np.int64, copy=False)
    return _bucketed_permutation(n, rng)


# From this many items on, the permutation is drawn bucket by bucket (below): one Fisher-Yates
# pass over ten million int64 jumps across 80 MB and waits on memory for most of its swaps.
_BUCKETED_FROM = 1 << 20
_BUCKETS = 256


def _bucketed_permutation(n: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random permutation of ``0..n-1`` that stays in cache (Rao-Sandelius).

    Every index draws one of ``_BUCKETS`` buckets uniformly; a stable radix sort of the bucket
    labels groups the indices by bucket; each bucket, small enough for the cache, is shuffled
    on its own; the buckets follow each other in label order. Independent uniform buckets and a
    uniform shuffle inside each make every permutation equally likely, and the cost is a few
    linear passes instead of ``n`` cache misses.
    """
    labels = rng.integers(0, _BUCKETS, size=n, dtype=np.uint8)
    order = np.argsort(labels, kind="stable")
    # Where each bucket ends in the grouped order (labels[order] is sorted).
    ends = np.searchsorted(labels[order], np.arange(1, _BUCKETS + 1)).tolist()
    start = 0
    for end in ends:
        rng.shuffle(order[start:end])
        start = end
    return order.astype(np.int64, copy=False)


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
