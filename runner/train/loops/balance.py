"""Rows balanced across ranks by tokens (``train.balance_ranks`` with
``train.max_tokens_per_microbatch`` on several ranks): every rank gathers a step's rows
(``gather_step``) and computes the same split of each optimizer step's rows between the ranks,
a prompt's rows together, largest first, to the rank with the fewest tokens
(``balance_by_tokens``); each rank trains its share under the whole minibatch's normaliser,
so the update is the unbalanced one's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from runner.ranks.collective import Collective, interleave
from runner.train.loops.batches import (
    Layout,
    LossFn,
    Minibatch,
    pack_by_tokens,
    reduce_history,
    train_minibatch,
)
from runner.train.roles import Trainable

if TYPE_CHECKING:
    from runner.recipe.schema import TrainConfig


def balance_by_tokens(lengths: Sequence[float], world: int, budget: int,
                      units: Sequence[int] | None = None) -> list[list[list[int]]]:
    """Rows ``0 .. len(lengths) - 1`` of every rank split between ``world`` ranks by tokens,
    then each rank's packed into micro-batches within ``budget`` (``pack_by_tokens``). Rows of
    the same ``units`` value move together (a prompt's rows: a padding-free forward computes
    their shared prompt once per micro-batch); without ``units`` each row is a unit of its
    own. Units in order of decreasing tokens (ties: the one with the lowest row first), each
    to the rank with the fewest tokens so far (ties: the lower rank). Every rank then holds
    about as many tokens (the busiest no more than the last unit it took over the least busy:
    with many units, a small one), and so about as many micro-batches
    (``train_minibatch_keeping``'s pads make up a difference). Per rank, its micro-batches,
    each row list ascending. A pure function of its arguments: every rank computes the same
    split.

    >>> balance_by_tokens([5, 3, 8, 2, 4], 2, 8)
    [[[2], [1]], [[0, 3], [4]]]
    >>> balance_by_tokens([9, 1, 1, 1], 3, 8)
    [[[0]], [[1, 3]], [[2]]]
    >>> balance_by_tokens([6, 6, 2, 2], 2, 16, units=[0, 0, 1, 1])
    [[[0, 1]], [[2, 3]]]
    """
    members: dict[int, list[int]] = {}
    for i, unit in enumerate(range(len(lengths)) if units is None else units):
        members.setdefault(unit, []).append(i)
    groups = list(members.values())
    sizes = [sum(lengths[i] for i in g) for g in groups]
    owned: list[list[int]] = [[] for _ in range(world)]
    loads = [0.0] * world
    for g in sorted(range(len(groups)), key=lambda g: (-sizes[g], groups[g][0])):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owned[rank] += groups[g]
        loads[rank] += sizes[g]
    shares = []
    for rows in owned:
        rows.sort()
        shares.append([[rows[j] for j in piece]
                       for piece in pack_by_tokens([lengths[i] for i in rows], budget)])
    return shares


def balanced_minibatch(layout: Layout, train: TrainConfig, mb: Minibatch,
                       lengths: Sequence[float]) -> tuple[Minibatch, list[list[int]], int,
                                                          dict[str, float]]:
    """This rank's share of a minibatch ``mb`` of *global* rows (every rank holds all of
    them: ``rows`` and ``weights`` of the whole minibatch) split by tokens between the ranks
    (``split_by_tokens``; the minibatch's rows of one item, a prompt's, kept on one rank;
    ``lengths``: every global row's tokens, indexed by row; the data order of ``layout`` gave
    item i to rank i % world)."""
    return split_by_tokens(layout.rank, layout.world, train, mb, lengths,
                           owners=[(r // layout.chunk) % layout.world for r in mb.rows],
                           units=[r // layout.chunk for r in mb.rows])


def split_by_tokens(rank: int, world: int, train: TrainConfig, mb: Minibatch,
                    lengths: Sequence[float], owners: Sequence[int],
                    units: Sequence[int] | None = None
                    ) -> tuple[Minibatch, list[list[int]], int, dict[str, float]]:
    """Rank ``rank``'s share of a minibatch ``mb`` of global rows split between ``world``
    ranks by tokens (``balance_by_tokens`` within ``train.max_tokens_per_microbatch``, rows of
    one of ``units`` together; ``owners``: per row of ``mb``, the rank the data order gave it):
    the share as a ``Minibatch`` of global rows (the normaliser stays the whole minibatch's),
    its micro-batches, how many every rank runs and the ``batch/*`` metrics, with the tokens
    per rank the data order gave (``batch/rank_imbalance_before``: the most over the mean) and
    the split gives (``batch/rank_imbalance``). Needs no collective: every rank computes the
    same split."""
    budget = train.max_tokens_per_microbatch
    tokens = [lengths[r] for r in mb.rows]
    shares = [[sorted(mb.rows[i] for i in piece) for piece in share]
              for share in balance_by_tokens(tokens, world, budget, units)]
    weights = dict(zip(mb.rows, mb.weights, strict=True))
    pieces = shares[rank]
    mine = sorted(r for piece in pieces for r in piece)
    count = max(1, max(len(s) for s in shares))
    after = [sum(lengths[r] for piece in share for r in piece) for share in shares]
    before = [0.0] * world
    for r, owner in zip(mb.rows, owners, strict=True):
        before[owner] += lengths[r]
    sizes = [[sum(lengths[r] for r in piece) for piece in share] for share in shares]
    slots = sum(sum(max(budget, n) for n in s) + (count - len(s)) * budget for s in sizes)
    real = sum(after)
    packing = {"batch/micro_batches": float(count),
               "batch/tokens_per_rank_max": float(max(after)),
               "batch/pad_frac": 1.0 - real / slots if slots else 0.0,
               "batch/rank_imbalance": _imbalance(after),
               "batch/rank_imbalance_before": _imbalance(before)}
    return (Minibatch(mine, [weights[r] for r in mine], mb.total), pieces, count, packing)


def balanced_batch_step(policy: Trainable, comm: Collective, train: TrainConfig,
                        owners: Sequence[int], weights: Sequence[float], denominator: float,
                        loss_fn: LossFn, lengths: Sequence[float]) -> dict[str, float]:
    """``whole_batch_step`` over the rows of every rank (global indices: ``loss_fn`` reads
    every rank's rows; ``owners[i]``: the rank the data order gave row i) split between the
    ranks by tokens (``split_by_tokens``, each row a unit of its own)."""
    whole = Minibatch(list(range(len(weights))), list(weights), denominator)
    mb, pieces, accum, packing = split_by_tokens(comm.ctx.rank, comm.world, train, whole,
                                                 lengths, owners)
    history = [train_minibatch([policy], mb, loss_fn, accum, comm.world, train.max_grad_norm,
                               pieces)]
    policy.scheduler.step()
    return {**reduce_history(comm, history), "lr": policy.scheduler.get_last_lr()[0], **packing}


def _imbalance(tokens: Sequence[float]) -> float:
    """The most tokens of any rank over the mean (1: even; 1 also when there are none)."""
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean > 0 else 1.0


def gather_step(comm: Collective, layout: Layout, packer: Any, inputs: Sequence[Any],
                grids: Sequence[torch.Tensor | None], device: Any, flag: bool = False
                ) -> tuple[Any, list[Any], list[torch.Tensor | None], bool]:
    """Every rank's rows of a step in global row order, in one collective: what a rank trains
    on when any global row may be its (``balanced_minibatch``). This rank gives its policy
    inputs (``inputs``, one per local row, the padding rows left out; they cross as plain
    tuples) and per-row grids (``grids``: [local rows, ...] each, or None; they cross as CPU
    tensors). Returns the batch of every rank's inputs collated by ``packer`` on ``device``
    (None when no rank has a row), those inputs, each grid over every rank's rows on its
    device in its dtype (a 2-D one zero-padded on the right to the widest rank's), and whether
    ``flag`` is true on any rank."""
    from runner.packers.base import RLPolicyInput

    mine = ([x.to_plain() for x in inputs],
            [None if g is None else g.detach().cpu() for g in grids], flag)
    per_rank = comm.gather(mine)
    every = [RLPolicyInput.from_plain(x)
             for x in interleave([p[0] for p in per_rank], chunk=layout.chunk)]
    joined = [None if grid is None else _joined(layout, [p[1][j] for p in per_rank], grid)
              for j, grid in enumerate(grids)]
    batch = packer.collate(every).to(device) if every else None
    return batch, every, joined, any(p[2] for p in per_rank)


def _joined(layout: Layout, per_rank: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of a grid in global row order, on ``like``'s device."""
    if like.ndim == 2:
        width = max(g.shape[1] for g in per_rank)
        per_rank = [torch.nn.functional.pad(g, (0, width - g.shape[1])) for g in per_rank]
    rows = interleave([list(g) for g in per_rank], chunk=layout.chunk)
    if not rows:
        return torch.zeros((0, *per_rank[0].shape[1:]), dtype=like.dtype, device=like.device)
    return torch.stack(rows).to(like.device)


def balances(comm: Collective, train: TrainConfig) -> bool:
    """Whether the update passes split each optimizer step's rows between the ranks by tokens
    (``balanced_minibatch``): with a token budget, ``train.balance_ranks`` and several ranks
    (``runner.recipe.plan.ranks_balanced``, what the dry run shows)."""
    from runner.recipe.plan import ranks_balanced

    return ranks_balanced(train, comm.world)
