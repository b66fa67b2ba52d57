"""Collectives between the policy ranks, behind a few plain methods.

With one rank every method is the identity and nothing touches ``torch.distributed``. With
several, the default process group (gloo on CPU, NCCL on GPU) carries them; every call is
bounded by ``launch.collective_timeout_s``, so a dead peer ends the run instead of hanging it.
Values cross as float64 tensors or small plain Python objects, never user objects. A thread
that talks to the other ranks beside the training thread (the producer's dynamic-sampling
draws) does so over a second group of its own (``beside``), so that the two threads' calls
never interleave.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from runner.ranks.context import RankContext


class Collective:
    def __init__(self, ctx: RankContext, device: torch.device | str = "cpu",
                 group: Any = None) -> None:
        self.ctx = ctx
        self.device = torch.device(device)
        self.group = group  # the process group the calls use (None: the default one)

    @property
    def world(self) -> int:
        return self.ctx.world_size

    @classmethod
    def start(cls, ctx: RankContext, *, timeout_s: float, device: str) -> Collective:
        """Join (or create) the default process group of ``ctx``'s world; ``device`` (the
        recipe's device type, decided once per rank) is the one this rank computes on, which
        the run reads back as ``comm.device``."""
        use_cuda = device == "cuda"
        on = torch.device("cuda", ctx.local_rank) if use_cuda else torch.device("cpu")
        if ctx.world_size == 1:
            return cls(ctx, on)
        import torch.distributed as dist

        if use_cuda:
            torch.cuda.set_device(on)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo",
                                    timeout=timedelta(seconds=timeout_s), rank=ctx.rank,
                                    world_size=ctx.world_size)
        return cls(ctx, on)

    def beside(self, timeout_s: float) -> Collective:
        """The same ranks' collectives over a process group of their own (gloo: plain data on
        the CPU), each call bounded by ``timeout_s``: for a thread whose calls run while this
        collective's run on another (the producer's dynamic-sampling draws). Every rank makes
        it once, at the same point of the run; with one rank it is this collective."""
        if self.world == 1:
            return self
        import torch.distributed as dist

        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        return Collective(self.ctx, "cpu", group)

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks of equally long lists of numbers."""
        if self.world == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.cpu().tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any."""
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (plain data), in rank order, on every rank."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def close(self) -> None:
        # vLLM's engine shutdown destroys the default process group it joined: closing after
        # it is a no-op. (A group made by ``beside`` goes with the default one.)
        if self.world > 1 and self.group is None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def local_process_group(device: torch.device | str = "cpu") -> None:
    """A default process group for one process, for the libraries that need one (FSDP2, vLLM),
    unless the ranks' group exists: an in-memory store, nothing listening on any address;
    gloo on CPU, NCCL on CUDA. (Every process group of a run is made in this module.)"""
    import torch.distributed as dist

    device = torch.device(device)
    if not dist.is_initialized():
        cuda = device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if cuda else None)


def interleave(per_rank: Sequence[Sequence[Any]], chunk: int = 1) -> list[Any]:
    """The global order of values sharded by the data rule: rank r holds items r, r + w, ...,
    each item contributing ``chunk`` consecutive values (e.g. a GRPO group).

    >>> interleave([[0, 2, 4], [1, 3]])
    [0, 1, 2, 3, 4]
    >>> interleave([["a0", "a1"], ["b0", "b1"]], chunk=2)
    ['a0', 'a1', 'b0', 'b1']
    """
    world = len(per_rank)
    items = sum(len(p) for p in per_rank) // chunk
    out: list[Any] = []
    for i in range(items):
        local = (i // world) * chunk
        out += per_rank[i % world][local:local + chunk]
    return out
