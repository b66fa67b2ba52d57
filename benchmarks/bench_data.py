"""Data order, sharding and resume at scale.

Measures, for N items (default 10 million), shuffle on, world 4:
- the epoch order (one numpy permutation) and the four rank shards of it;
- resuming a stream from a cursor deep in an epoch: the time to the first batch, and how many
  items were read (only the batch itself: nothing before the cursor is touched).

Run: ``.venv/bin/python benchmarks/bench_data.py [--items N] [--repeats R]``. Prints a markdown
table row at the end.
"""

from __future__ import annotations

import argparse
import statistics
import time

from runner.data.columns import ColumnMap
from runner.data.cursor import DataCursor, PromptStream
from runner.data.order import epoch_order, shard
from runner.data.sources import PromptSource

WORLD, BATCH, SEED = 4, 16, 0


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.items

    order_s, shard_s = [], []
    for epoch in range(args.repeats):
        t_order, order = timed(lambda e=epoch: epoch_order(n, SEED, e, shuffle=True))
        # .copy() so the shards are materialised, not just views.
        t_shard, shards = timed(lambda o=order: [shard(o, r, WORLD).copy() for r in range(WORLD)])
        assert sum(len(s) for s in shards) == n
        order_s.append(t_order)
        shard_s.append(t_shard)

    read: list[int] = []

    def fetch(i: int) -> dict[str, str]:
        read.append(i)
        return {"prompt": f"item {i}"}

    source = PromptSource(fetch, n, kind="bench", label="bench", identity={"source": "bench"},
                          columns=ColumnMap(prompt="prompt"), shuffle=True)
    position = (n * 9 // 10) // WORLD * WORLD
    cursor = DataCursor(epoch=2, position=position, seed=SEED, fingerprint=source.fingerprint())
    resume_s, batch = timed(lambda: PromptStream(source, SEED, True, rank=1, world=WORLD,
                                                 cursor=cursor).next_indexed(BATCH))
    expected = shard(epoch_order(n, SEED, 2, True)[position:position + BATCH * WORLD], 1, WORLD)
    assert [i for i, _ in batch] == expected.tolist()
    assert read == expected.tolist()

    order_m, shard_m = statistics.median(order_s), statistics.median(shard_s)
    print(f"items {n:,}, world {WORLD}, shuffle on, {args.repeats} repeats (median)")
    print(f"  epoch order (permutation): {order_m:.3f} s")
    print(f"  {WORLD} shards:                 {shard_m:.3f} s")
    print(f"  order + shard:             {order_m + shard_m:.3f} s")
    print(f"  resume at epoch 2 position {position:,}: first batch of {BATCH} in "
          f"{resume_s:.3f} s, {len(read)} items read (none before the cursor)")
    print()
    print("| benchmark | items | order s | shard s | order+shard s | resume to first batch s "
          "| items read on resume |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| data order + shard (world {WORLD}, shuffle) | {n:,} | {order_m:.3f} | "
          f"{shard_m:.3f} | {order_m + shard_m:.3f} | {resume_s:.3f} | {len(read)} |")


if __name__ == "__main__":
    main()
