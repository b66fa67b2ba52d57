"""Batches across ranks: which rows of the global batch this rank holds, minibatches drawn
from the global order, each micro-batch's share of the global loss, and metric reduction.

The data rule (``runner.data.order``) gives rank r the items r, r + w, r + 2w, ... of every
global batch; an item contributes ``chunk`` consecutive rows (its samples). Every rank draws
the same permutation of the *global* rows for each epoch, so a minibatch is the same set of
rows whatever the number of ranks, and each rank trains on the part of it that it holds. Loss
normalisers (tokens or sequences of the whole minibatch) are global, and every micro-batch loss
is multiplied by the world size because DDP averages gradients over ranks: one rank or N, the
update is that of the one big batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from runner.algorithms.masked import masked_sum
from runner.ranks.collective import Collective, interleave
from runner.train.assembly.seeds import step_seed
from runner.train.roles import FrozenScorer, Trainable, optimizer_step

if TYPE_CHECKING:
    from runner.recipe.schema import TrainConfig


@attrs.frozen
class Layout:
    """This rank's place in a global batch of ``items`` items of ``chunk`` rows each."""

    rank: int
    world: int
    items: int  # global items per step
    chunk: int  # rows per item

    @property
    def global_rows(self) -> int:
        return self.items * self.chunk

    def global_row(self, local: int) -> int:
        """The global row of local row ``local``."""
        item, sample = divmod(local, self.chunk)
        return (item * self.world + self.rank) * self.chunk + sample

    @property
    def local_rows_count(self) -> int:
        """The rows this rank holds (its items r, r + world, ... below ``items``)."""
        return len(range(self.rank, self.items, self.world)) * self.chunk

    def global_item(self, local_item: int) -> int:
        return local_item * self.world + self.rank

    def local_rows(self, global_rows: torch.Tensor) -> list[int]:
        """Local indices of the global rows this rank holds, in the given order."""
        out = []
        for g in global_rows.tolist():
            item, sample = divmod(g, self.chunk)
            if item % self.world == self.rank:
                out.append((item // self.world) * self.chunk + sample)
        return out


def gather_rows(comm: Collective, layout: Layout, values: Sequence[Any]) -> list[Any]:
    """Per-row values of every rank, in global row order."""
    return interleave(comm.gather(list(values)), chunk=layout.chunk)


def split_even(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering range(n), sizes differing by at most one."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def pack_by_tokens(lengths: Sequence[float], budget: int) -> list[list[int]]:
    """Rows ``0 .. len(lengths) - 1`` packed into micro-batches of at most ``budget`` tokens by
    best-fit decreasing: rows in order of decreasing length (ties: the lower index first), each
    into the open micro-batch it leaves the least room in (ties: the earlier one), else a new
    one. A row longer than ``budget`` is a micro-batch of its own (rows are never cut).
    Micro-batches in the order they were opened, each row list ascending.

    >>> pack_by_tokens([5, 3, 8, 2, 4], 8)
    [[2], [0, 1], [3, 4]]
    >>> pack_by_tokens([3, 12, 3, 3], 8)
    [[1], [0, 2], [3]]
    >>> pack_by_tokens([], 8)
    []
    """
    bins: list[list[int]] = []
    room: list[float] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            best = min(fits, key=lambda b: (room[b], b))
            bins[best].append(i)
            room[best] -= lengths[i]
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def micro_pieces(train: TrainConfig, lengths: Sequence[float], scoring: bool = False
                 ) -> list[list[int]]:
    """The micro-batches an offline step splits its ``len(lengths)`` rows into: packed by
    tokens within ``train.max_tokens_per_microbatch`` when it is set, else ``grad_accum_steps``
    contiguous pieces of (nearly) equal row counts. A ``scoring`` pass packs within
    ``train.logprob_max_tokens_per_microbatch`` when that is set, else as the update does."""
    if scoring and train.logprob_max_tokens_per_microbatch > 0:
        return pack_by_tokens(lengths, train.logprob_max_tokens_per_microbatch)
    if train.max_tokens_per_microbatch > 0:
        return pack_by_tokens(lengths, train.max_tokens_per_microbatch)
    return [list(range(len(lengths))[s])
            for s in split_even(len(lengths), max(1, train.grad_accum_steps))]


@attrs.frozen
class Minibatch:
    rows: list[int]  # this rank's local rows
    weights: list[float]  # each local row's part of the normaliser (its tokens, or 1)
    total: float  # the normaliser of the whole global minibatch


def minibatches(layout: Layout, weights_global: Sequence[float], n_minibatches: int,
                generator_seed: int) -> list[Minibatch]:
    """The epoch's minibatches: a permutation of the global rows seeded by ``generator_seed``
    (the same on every rank), split into ``n_minibatches`` even parts."""
    generator = torch.Generator().manual_seed(generator_seed)
    order = torch.randperm(layout.global_rows, generator=generator)
    out = []
    for part in split_even(layout.global_rows, n_minibatches):
        rows_global = order[part]
        local = layout.local_rows(rows_global)
        total = float(sum(weights_global[g] for g in rows_global.tolist()))
        out.append(Minibatch(local, [weights_global[layout.global_row(r)] for r in local], total))
    return out


# metrics: floats or 0-d tensors
LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


# Like LossFn, with a third value the caller keeps (GRPO: the rows' detached logprobs).
KeepingLossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, Any], Any]]


def train_minibatch(trainables: Sequence[Trainable], mb: Minibatch, loss_fn: LossFn, accum: int,
                    world: int, max_grad_norm: float,
                    pieces: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """One optimizer step over this rank's part of ``mb``, in up to ``accum`` micro-batches:
    ``mb.rows`` split into ``accum`` pieces of (nearly) equal row counts or, given ``pieces``
    (lists of ``mb``'s rows), those; ``accum`` is then the number every rank runs (the most
    pieces of any rank) when the ranks run together.

    ``loss_fn(rows)`` returns the loss normalised within those rows (a mean over their tokens
    or sequences) and its metrics; each is weighted by the rows' share of the global
    minibatch. Returns this rank's share-weighted metrics (summing them over ranks gives the
    minibatch's) and the gradient norm. A rank that holds no row of ``mb`` still takes part
    (DDP synchronises every rank) with a zero-weighted loss on its first row.
    """
    def keeping(rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any], None]:
        return (*loss_fn(rows), None)

    return train_minibatch_keeping(trainables, mb, keeping, accum, world, max_grad_norm,
                                   pieces)[0]


def whole_batch_step(policy: Trainable, comm: Collective, train: TrainConfig,
                     weights: Sequence[float], denominator: float, loss_fn: LossFn,
                     lengths: Sequence[float] = ()) -> dict[str, float]:
    """One optimizer step of ``policy`` over this rank's rows of the global batch (the offline
    kinds: DPO, RM, SFT): row ``i`` weighs ``weights[i]`` in a global mean over
    ``denominator``. The metrics reduced over ranks, and the learning rate.

    With ``train.max_tokens_per_microbatch`` set, the rows are packed into micro-batches by
    their token counts ``lengths`` (``micro_pieces``); every rank runs as many as the rank with
    the most (the others zero-weighted pads), which the metrics report (``batch/*``)."""
    whole = Minibatch(list(range(len(weights))), list(weights), denominator)
    pieces, accum, packing = None, train.grad_accum_steps, {}
    if train.max_tokens_per_microbatch > 0:
        pieces, accum, packing = _packed_by_tokens(comm, train, len(weights), lengths)
    history = [train_minibatch([policy], whole, loss_fn, accum, comm.world, train.max_grad_norm,
                               pieces)]
    policy.scheduler.step()
    return {**reduce_history(comm, history), "lr": policy.scheduler.get_last_lr()[0], **packing}


def _packed_by_tokens(comm: Collective, train: TrainConfig, rows: int, lengths: Sequence[float]
                      ) -> tuple[list[list[int]], int, dict[str, float]]:
    """This rank's micro-batches packed within the token budget, how many every rank runs (the
    most of any rank) and the ``batch/*`` metrics of the step."""
    if len(lengths) != rows:
        raise ValueError(f"{rows} rows but {len(lengths)} token counts")
    budget = train.max_tokens_per_microbatch
    pieces = micro_pieces(train, lengths)
    sizes = [sum(lengths[i] for i in p) for p in pieces]
    per_rank = comm.gather([len(pieces), sum(sizes), sum(max(budget, n) for n in sizes)])
    count = max(1, max(n for n, _, _ in per_rank))
    # a rank's slots: each of its micro-batches holds the budget (an oversize row: its own
    # tokens), and each pad micro-batch an empty budget
    slots = sum(cap + (count - n) * budget for n, _, cap in per_rank)
    real = sum(tokens for _, tokens, _ in per_rank)
    return pieces, count, {"batch/micro_batches": float(count),
                           "batch/tokens_per_rank_max": float(max(t for _, t, _ in per_rank)),
                           "batch/pad_frac": 1.0 - real / slots if slots else 0.0}


def packed_minibatch(comm: Collective, train: TrainConfig, mb: Minibatch,
                     lengths: Sequence[float]) -> tuple[list[list[int]], int, dict[str, float]]:
    """This rank's rows of minibatch ``mb`` packed by their token counts (``lengths``: one per
    local row of the step, indexed by row) within ``train.max_tokens_per_microbatch``: the
    micro-batches (lists of ``mb``'s rows), how many every rank runs and the ``batch/*``
    metrics (``_packed_by_tokens``)."""
    pieces, count, packing = _packed_by_tokens(comm, train, len(mb.rows),
                                               [lengths[r] for r in mb.rows])
    return [[mb.rows[i] for i in piece] for piece in pieces], count, packing


def whole_or_rows(batch: Any, rows: Sequence[int]) -> Any:
    """``batch`` itself when ``rows`` are all of its rows in order, else those rows
    (``select_rows``): a scoring pass over the whole batch runs exactly as it always has."""
    if list(rows) == list(range(batch.input_ids_BT.shape[0])):
        return batch
    return select_rows(batch, torch.tensor(list(rows)))


def scored_by_tokens(comm: Collective, budget: int, rows: Sequence[int],
                     lengths: Sequence[float], shape: tuple[int, int],
                     score: Callable[[list[int]], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """A scoring pass (logprobs or values of sampled tokens, no gradient) over ``rows`` of a
    batch, in micro-batches of at most ``budget`` tokens (``lengths``: every row's tokens,
    indexed by row; ``pack_by_tokens``; 0: one pass over ``rows``). ``score(piece)`` returns
    the piece's [len(piece), w <= shape[1]] values, written into a ``shape`` grid (zeros past
    a piece's width and in rows not scored). With several ranks every rank calls ``score`` as
    often as the busiest (a model's forward may be a collective: DDP's buffer broadcast,
    FSDP's parameter gathers); the extra calls score ``rows[0]`` (or row 0) and are dropped.
    Returns the grid (float32 zeros when no rank scored a row) and the number of passes every
    rank ran."""
    rows = list(rows)
    pieces = ([[rows[i] for i in p] for p in pack_by_tokens([lengths[r] for r in rows], budget)]
              if budget > 0 else [rows] if rows else [])
    if budget <= 0:
        count = 1  # one pass on every rank (a rank with no row to score: a dropped filler)
    else:
        count = max(comm.gather(len(pieces))) if comm.world > 1 else len(pieces)
    out: torch.Tensor | None = None
    for piece in pieces:
        values = score(piece)
        if out is None:
            out = torch.zeros(shape, dtype=values.dtype, device=values.device)
        out[torch.tensor(piece, device=values.device), :values.shape[1]] = values
    for _ in range(count - len(pieces)):
        filler = score(rows[:1] or [0])
        if out is None:
            out = torch.zeros(shape, dtype=filler.dtype, device=filler.device)
    if out is None:  # no rank had a row to score
        out = torch.zeros(shape)
    return out, count


def minibatch_pieces(comm: Collective, layout: Layout, train: TrainConfig, mb: Minibatch,
                     lengths: Sequence[float], packings: list[dict[str, float]]
                     ) -> tuple[Minibatch, list[list[int]] | None, int]:
    """What this rank trains of minibatch ``mb`` for ``train_minibatch``: the minibatch, its
    micro-batches and how many every rank runs. With the ranks balanced by tokens
    (``balances``; ``mb`` then holds global rows) this rank's share of them
    (``balanced_minibatch``); else ``mb`` itself, packed by tokens with
    ``train.max_tokens_per_microbatch`` (``packed_minibatch``), or ``None`` and
    ``train.grad_accum_steps``. The ``batch/*`` metrics of a packing are appended to
    ``packings``."""
    from runner.train.loops.balance import balanced_minibatch, balances

    if train.max_tokens_per_microbatch <= 0:
        return mb, None, train.grad_accum_steps
    if balances(comm, train):
        mb, pieces, accum, packing = balanced_minibatch(layout, train, mb, lengths)
    else:
        pieces, accum, packing = packed_minibatch(comm, train, mb, lengths)
    packings.append(packing)
    return mb, pieces, accum


def epoch_minibatches(layout: Layout, weights: Sequence[float], count: int, seed: int,
                      step: int, epochs: int) -> list[list[Minibatch]]:
    """Every epoch's ``count`` minibatches of a step (``minibatches``, each epoch shuffled by
    its own seed from (run seed, step, epoch)) for ``layout``'s rank; with a layout of one
    rank, as sets of global rows."""
    return [minibatches(layout, weights, count, step_seed(seed, step, salt=1 + epoch))
            for epoch in range(epochs)]


def row_tokens(batch: Any, train: TrainConfig) -> list[float]:
    """Each row's tokens (prompt and completion) of a padded batch, what a token budget packs;
    empty when neither budget is set."""
    if train.max_tokens_per_microbatch <= 0 and train.logprob_max_tokens_per_microbatch <= 0:
        return []
    return [float(n) for n in batch.attention_mask_BT.sum(-1).tolist()]


def mean_packing(packings: Sequence[dict[str, float]]) -> dict[str, float]:
    """The ``batch/*`` metrics of a step of several optimizer steps: micro-batches, padding and
    (ranks balanced by tokens) the ranks' imbalance per optimizer step (means), the most tokens
    any rank held in one."""
    if not packings:
        return {}
    n = len(packings)
    out = {"batch/micro_batches": sum(p["batch/micro_batches"] for p in packings) / n,
           "batch/tokens_per_rank_max": max(p["batch/tokens_per_rank_max"] for p in packings),
           "batch/pad_frac": sum(p["batch/pad_frac"] for p in packings) / n}
    for key in ("batch/rank_imbalance", "batch/rank_imbalance_before"):  # balanced ranks
        if all(key in p for p in packings):
            out[key] = sum(p[key] for p in packings) / n
    return out


def train_minibatch_keeping(trainables: Sequence[Trainable], mb: Minibatch,
                            loss_fn: KeepingLossFn, accum: int, world: int, max_grad_norm: float,
                            pieces: Sequence[Sequence[int]] | None = None
                            ) -> tuple[dict[str, float], list[tuple[torch.Tensor, Any]]]:
    """``train_minibatch`` whose loss also returns a value per micro-batch: returns the metrics
    and, in micro-batch order, (the rows ``loss_fn`` was called with, its third value).

    With several ranks every forward is a collective (sharded trainables, FSDP2, gather their
    parameters; DDP broadcasts the model's buffers, e.g. rotary frequencies): there, every rank
    runs ``accum`` micro-batches, a rank with fewer pieces than that a zero-weighted loss on its
    first row for each missing one (neither kept nor counted in the metrics). ``pieces``: as
    in ``train_minibatch``."""
    if pieces is None:
        pieces = [mb.rows[s] for s in split_even(len(mb.rows), max(1, accum))]
    pieces = [list(p) for p in pieces if p] or [[]]
    together = world > 1 or any(t.sharded for t in trainables)
    pads = max(1, accum) - len(pieces) if together else 0
    weights = dict(zip(mb.rows, mb.weights, strict=True))
    sums: dict[str, float] = {}
    kept: list[tuple[torch.Tensor, Any]] = []

    def micro(rows: list[int], pad: bool = False) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            share = sum(weights[r] for r in rows) / mb.total if rows and mb.total else 0.0
            idx = torch.tensor(rows or [0])
            loss, metrics, value = loss_fn(idx)
            if pad:
                return loss * 0.0
            kept.append((idx, value))
            for k, v in metrics.items():
                sums[k] = _accumulate(k, sums.get(k), v, share, bool(rows))
            return loss * (share * world)

        return run

    norm = optimizer_step(trainables, [micro(p) for p in pieces]
                          + [micro([], pad=True) for _ in range(pads)], max_grad_norm)
    # The metrics stay tensors through the micro-batches: read once, after the step.
    return {**{k: float(v) for k, v in sums.items()}, "grad_norm": norm / world}, kept


def global_whiten(comm: Collective, x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``masked_whiten`` over the masked elements of every rank: the unbiased variance of the
    global batch, (x - mean) / sqrt(var + 1e-8), 0 outside the mask (everywhere when no rank
    has a masked element)."""
    total, count = comm.sum([float(masked_sum(x_BT, mask_BT)), float(mask_BT.sum())])
    mean = total / max(1.0, count)
    sq = comm.sum([float(masked_sum((x_BT - mean) ** 2, mask_BT))])[0]
    var = sq / max(1.0, count - 1)
    return torch.where(mask_BT, (x_BT - mean) * (var + 1e-8) ** -0.5, torch.zeros_like(x_BT))


# Metrics named NAME_min / NAME_max are extremes: the smallest / largest value of any
# micro-batch, rank and optimizer step, not share-weighted means.
EXTREMES: dict[str, tuple[Callable[[Any, Any], Any], float]] = {
    "_min": (torch.minimum, math.inf), "_max": (torch.maximum, -math.inf)}


def _extreme(key: str) -> tuple[Callable[[Any, Any], Any], float] | None:
    return next((e for suffix, e in EXTREMES.items() if key.endswith(suffix)), None)


def _accumulate(key: str, acc: Any, value: Any, share: float, has_rows: bool) -> Any:
    """A micro-batch's metric added to the optimizer step's: weighted by its share, or, for an
    extreme, the smaller / larger of the two (a micro-batch of no row counts as none)."""
    extreme = _extreme(key)
    if extreme is None:
        return (0.0 if acc is None else acc) + value * share
    pick, fill = extreme
    value = torch.as_tensor(value if has_rows else fill, dtype=torch.float64)
    return value if acc is None else pick(torch.as_tensor(acc, dtype=torch.float64), value)


def reduce_history(comm: Collective, history: Sequence[dict[str, float]]) -> dict[str, float]:
    """Sum each optimizer step's share-weighted metrics over ranks, then average over steps; an
    extreme (``NAME_min`` / ``NAME_max``) is the smallest / largest over ranks and steps."""
    keys = sorted({k for h in history for k in h if _extreme(k) is None})
    flat = comm.sum([h.get(k, 0.0) for h in history for k in keys])
    n = len(history)
    out = {k: sum(flat[i * len(keys) + j] for i in range(n)) / max(1, n)
           for j, k in enumerate(keys)}
    extremes = sorted({k for h in history for k in h if _extreme(k) is not None})
    if extremes:
        per_rank = comm.gather([[h[k] for h in history if k in h] for k in extremes])
        for j, k in enumerate(extremes):
            pick = min if k.endswith("_min") else max
            values = [v for rank in per_rank for v in rank[j] if math.isfinite(v)]
            if values:  # none: no micro-batch held a row
                out[k] = pick(values)
    return out


def select_rows(batch: Any, idx: torch.Tensor) -> Any:
    """Rows ``idx`` of a padded batch, trimmed to their longest sequence (with the packer's
    extra model inputs of those rows)."""
    return batch.select(idx)


def rank_mean(comm: Collective, values: dict[str, float]) -> dict[str, float]:
    """Per-key means over ranks of per-rank means over equally many items (reward parts)."""
    summed = comm.sum(list(values.values()))
    return {k: v / comm.world for k, v in zip(values, summed, strict=True)}


@contextlib.contextmanager
def lockstep(comm: Collective, mine: int, packer: Any, device: Any,
             *models: Trainable | FrozenScorer | None) -> Iterator[None]:
    """Around a rank's ``mine`` forwards of ``models`` (in the order it runs them): afterwards,
    filler forwards of those whose forwards are collectives (``lockstep``: every trained model
    when there are several ranks, a sharded frozen one), until this rank has run as many as the
    busiest rank. Ranks hold unequal shares of a held-out set; each forward of a sharded model
    gathers its parameters and each forward of a DDP model broadcasts its buffers. Every rank
    enters it (a collective itself) before its first forward. A filler is a one-row batch (a
    prompt and a completion token, both the pad id); what it computes is dropped."""
    together = [m for m in models if m is not None and m.lockstep]
    fillers = max(comm.gather(mine)) - mine if together else 0
    yield
    if fillers:
        from runner.packers.base import RLPolicyInput

        pad = packer.pad_token_id
        fill = packer.collate([RLPolicyInput((pad, pad), (0, 1), 1)]).to(device)
        with torch.no_grad():
            for _ in range(fillers):
                for model in together:
                    model.logits(fill)
