"""Epoch order and rank sharding: pure, complete, disjoint."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner.data.cursor import IndexStream
from runner.data.order import _BUCKETED_FROM, _bucketed_permutation, epoch_order, shard


def test_unshuffled_order_is_identity():
    assert epoch_order(5, seed=3, epoch=2, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_shuffled_order_is_a_pure_permutation_of_seed_and_epoch():
    a = epoch_order(1000, seed=7, epoch=0, shuffle=True)
    assert a.dtype == np.int64
    assert np.array_equal(np.sort(a), np.arange(1000))
    assert np.array_equal(a, epoch_order(1000, seed=7, epoch=0, shuffle=True))
    assert not np.array_equal(a, epoch_order(1000, seed=7, epoch=1, shuffle=True))
    assert not np.array_equal(a, epoch_order(1000, seed=8, epoch=0, shuffle=True))


def test_order_matches_an_independent_numpy_generator():
    # The documented recipe: default_rng([domain, seed, epoch]).permutation(n).
    expected = np.random.default_rng([0x64617461, 5, 2]).permutation(50)
    assert np.array_equal(epoch_order(50, seed=5, epoch=2, shuffle=True), expected)


def test_large_orders_are_bucketed_permutations():
    n = _BUCKETED_FROM + 3
    a = epoch_order(n, seed=5, epoch=2, shuffle=True)
    assert a.dtype == np.int64 and np.array_equal(np.sort(a), np.arange(n))
    expected = _bucketed_permutation(n, np.random.default_rng([0x64617461, 5, 2]))
    assert np.array_equal(a, expected)
    assert np.array_equal(a, epoch_order(n, seed=5, epoch=2, shuffle=True))
    assert not np.array_equal(a, epoch_order(n, seed=5, epoch=3, shuffle=True))


def test_bucketed_permutation_is_uniform():
    # All 3! orders of 3 items over 6,000 draws: each expected 1,000 times (sd ~29). A bias
    # from the buckets (e.g. toward keeping the input order within a bucket) would show here.
    rng = np.random.default_rng(0)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(6_000):
        key = tuple(_bucketed_permutation(3, rng).tolist())
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 6
    assert all(880 < c < 1120 for c in counts.values()), counts
    # Where item 0 lands among 3,000 places (several items per bucket): uniform by tenths.
    places = np.array([int(np.argmax(_bucketed_permutation(3_000, rng) == 0))
                       for _ in range(2_000)])
    hist = np.bincount(places // 300, minlength=10)
    assert all(140 < h < 260 for h in hist), hist


def test_negative_seed_is_accepted_and_distinct():
    a = epoch_order(100, seed=-1, epoch=0, shuffle=True)
    assert np.array_equal(np.sort(a), np.arange(100))
    assert not np.array_equal(a, epoch_order(100, seed=1, epoch=0, shuffle=True))


def test_shard_is_strided():
    assert shard(np.arange(10), 0, 3).tolist() == [0, 3, 6, 9]
    assert shard(np.arange(10), 2, 3).tolist() == [2, 5, 8]


@pytest.mark.parametrize("rank,world", [(0, 0), (2, 2), (-1, 2)])
def test_shard_rejects_bad_rank_or_world(rank, world):
    with pytest.raises(ValueError):
        shard(np.arange(4), rank, world)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 60), world=st.integers(1, 4), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 5))
def test_shards_cover_every_index_exactly_once(n, world, seed, epoch):
    order = epoch_order(n, seed, epoch, shuffle=True)
    shards = [shard(order, r, world) for r in range(world)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first n % world ranks take one more


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), world=st.integers(1, 4), batch=st.integers(1, 7),
       steps=st.integers(1, 12))
def test_ranks_of_a_stream_see_each_item_once_per_epoch(n, world, batch, steps):
    streams = [IndexStream(n, seed=1, shuffle=True, rank=r, world=world, fingerprint="f")
               for r in range(world)]
    taken = [np.concatenate([s.next_indices(batch) for _ in range(steps)]) for s in streams]
    # Laid end to end, the per-step blocks of all ranks are the epochs' orders in sequence.
    merged = np.stack([t.reshape(steps, batch) for t in taken], axis=2).reshape(-1)
    total = steps * batch * world
    expected = np.concatenate([epoch_order(n, 1, e, True) for e in range(total // n + 1)])
    assert np.array_equal(merged, expected[:total])
    assert len({s.cursor for s in streams}) == 1  # every rank holds the same cursor
