"""Token-budget micro-batches (``train.max_tokens_per_microbatch``) of the offline kinds: the
packing by hand, the same update as the ``grad_accum_steps`` split, ranks running equally many
micro-batches, the refusals, the metrics and the dry run's line.

The equality runs in float64 with padded batches, as tests/test_accumulation.py does and for
its reason: with padding-free layouts the models' RMSNorm (float32 whatever the dtype) would
round differently for rows packed with different neighbours."""

from __future__ import annotations

import doctest
import json
from types import SimpleNamespace

import pytest
import torch

from runner.errors import RecipeError
from runner.recipe import load_recipe
from runner.train.loops import batches
from runner.train.loops.batches import pack_by_tokens, whole_batch_step
from tests.conftest import REPO
from tests.resume_helpers import final_weights, rows

# --- the packing ------------------------------------------------------------------------------


@pytest.mark.parametrize(("lengths", "budget", "want"), [
    ([5, 3, 8, 2, 4], 8, [[2], [0, 1], [3, 4]]),
    ([3, 12, 3, 3], 8, [[1], [0, 2], [3]]),  # 12 alone, never cut
    ([4, 4, 4, 4], 8, [[0, 1], [2, 3]]),  # ties: the lower index first, the earlier bin
    ([7, 1, 6, 2], 8, [[0, 1], [2, 3]]),  # best fit: 1 fills 7's bin, 2 fills 6's
    ([9, 9], 8, [[0], [1]]),
    ([0, 8, 0], 8, [[0, 1, 2]]),
    ([], 8, []),
])
def test_pack_by_tokens_by_hand(lengths, budget, want):
    assert pack_by_tokens(lengths, budget) == want


def test_pack_by_tokens_docstring_examples():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(pack_by_tokens, "pack_by_tokens"):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
    assert runner.summarize(verbose=False).attempted == 3


def test_pack_by_tokens_keeps_the_budget_covers_every_row_and_is_deterministic():
    gen = torch.Generator().manual_seed(0)
    for budget in (1, 7, 20, 64):
        lengths = torch.randint(1, 40, (50,), generator=gen).tolist()
        pieces = pack_by_tokens(lengths, budget)
        assert sorted(i for p in pieces for i in p) == list(range(50))
        for p in pieces:
            assert len(p) == 1 or sum(lengths[i] for i in p) <= budget
            assert p == sorted(p)
        assert pack_by_tokens(list(lengths), budget) == pieces


# --- ranks run equally many micro-batches -----------------------------------------------------


class _TwoRanks:
    """This rank of two; the other rank's (pieces, tokens, slots) are given."""

    world = 2

    def __init__(self, other):
        self.other = other

    def sum(self, values):
        return [float(v) for v in values]

    def gather(self, value):
        return [value, self.other]


def test_a_rank_with_fewer_micro_batches_runs_zero_weighted_pads(monkeypatch):
    """Rank 0 packs its 3 rows into 2 micro-batches, rank 1 into 4: rank 0 runs 2 pads on its
    first row (neither weighted nor counted), and the metrics report 4 micro-batches."""
    monkeypatch.setattr(batches, "optimizer_step",
                        lambda trainables, losses, norm: float(sum(float(f()) for f in losses)))
    calls = []

    def loss_fn(idx):
        calls.append(idx.tolist())
        return torch.tensor(1.0), {"m": torch.tensor(2.0)}

    scheduler = SimpleNamespace(step=lambda: None, get_last_lr=lambda: [0.1])
    policy = SimpleNamespace(scheduler=scheduler, sharded=False)
    train = load_recipe(REPO / "recipes" / "sft-arith.toml",
                        ["train.max_tokens_per_microbatch=10"]).train
    out = whole_batch_step(policy, _TwoRanks([4, 36.0, 40.0]), train, [1.0, 1.0, 2.0], 8.0,
                           loss_fn, [6.0, 4.0, 9.0])
    assert calls == [[2], [0, 1], [0], [0]]
    assert out["batch/micro_batches"] == 4 and out["batch/tokens_per_rank_max"] == 36
    assert out["batch/pad_frac"] == pytest.approx(1 - (19 + 36) / (20 + 2 * 10 + 40))
    assert out["m"] == pytest.approx(2.0 * 4 / 8)  # this rank's share of the global mean
    assert out["grad_norm"] == pytest.approx(4 / 8)  # the pads add nothing


# --- the same update as the grad_accum_steps split --------------------------------------------

COMMON = ("run.max_steps=1", "data.validation.enabled=false", "model.dtype=float64",
          "logging.sample_every=0", "train.padding_free=false")
SHORT = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
LONG = [{"role": "system", "content": "Answer briefly."}, *SHORT,
        {"role": "user", "content": "19-12="}, {"role": "assistant", "content": "7"},
        {"role": "user", "content": "20+19="}, {"role": "assistant", "content": "39"}]


@pytest.fixture
def spied(monkeypatch):
    """Every packing a run makes: (lengths, budget, micro-batches)."""
    seen = []

    def spy(lengths, budget):
        pieces = pack_by_tokens(lengths, budget)
        seen.append((list(lengths), budget, pieces))
        return pieces

    monkeypatch.setattr(batches, "pack_by_tokens", spy)
    return seen


def _run(run_cli, out, recipe, *overrides):
    rc, stdout, stderr = run_cli("--plain", recipe, f"run.output_dir={out}", *COMMON, *overrides)
    assert rc == 0, stdout + stderr
    return rows(out)[-1], final_weights(out, 1)


def _same_update(a, b, keys):
    (row_a, weights_a), (row_b, weights_b) = a, b
    for k in keys:
        assert row_a[k] == pytest.approx(row_b[k], rel=1e-12, abs=0), k
    worst = max(float((weights_a[k] - weights_b[k]).abs().max()) for k in weights_a)
    assert worst < 1e-12, worst


def _budgets_used(spied):
    """Each run's micro-batch row counts and whether a row was over the budget."""
    return [([len(p) for p in pieces],
             any(len(p) == 1 and lengths[p[0]] > budget for p in pieces))
            for lengths, budget, pieces in spied]


def _packed_like(run_cli, tmp_path, spied, recipe, whole, keys, budgets):
    """For each budget: a run packed by it, which must update as ``whole`` does (``keys``);
    yields (budget, its rows, the micro-batch row counts, whether a row was over the budget)."""
    for budget in budgets:
        spied.clear()
        packed = _run(run_cli, tmp_path / f"b{budget}", *recipe,
                      f"train.max_tokens_per_microbatch={budget}")
        _same_update(packed, whole, keys)
        [(counts, oversize)] = _budgets_used(spied)
        yield budget, packed, counts, oversize


def test_sft_packed_by_tokens_updates_as_the_accumulated_step(run_cli, tmp_path, spied):
    """Conversations of unequal lengths (one long, five short): the update of budgets 60 (rows
    packed unevenly) and 40 (the long one over it, alone) is that of one micro-batch and of
    ``grad_accum_steps = 3``: loss and gradient norm to 1e-12 relative, weights to 1e-12."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n"
                            for m in [SHORT, LONG, SHORT, SHORT, SHORT, SHORT]))
    sft = ("recipes/sft-arith.toml", f"data.path={data}", "data.messages_column=messages",
           "algo.examples_per_step=6")
    whole = _run(run_cli, tmp_path / "whole", *sft)
    accum = _run(run_cli, tmp_path / "accum", *sft, "train.grad_accum_steps=3")
    keys = ("loss", "grad_norm", "sft/tokens")
    _same_update(whole, accum, keys)
    for budget, packed, counts, oversize in _packed_like(run_cli, tmp_path, spied, sft, whole,
                                                         keys, (60, 40)):
        assert len(counts) > 1 and len(set(counts)) > 1, counts
        assert oversize == (budget == 40)
        assert packed[0]["batch/micro_batches"] == len(counts)
        assert 0 <= packed[0]["batch/pad_frac"] < 1


def test_rm_packed_by_tokens_updates_as_the_accumulated_step(run_cli, tmp_path, spied):
    """Pairs of 28 and 30 tokens (chosen and rejected together): budgets 100 (micro-batches of
    3, 3 and 2 pairs) and 29 (the 30-token pairs over it) update as one micro-batch and as
    ``grad_accum_steps = 2``."""
    rm = ("recipes/rm-arith.toml", "algo.pairs_per_step=8")
    whole = _run(run_cli, tmp_path / "whole", *rm)
    accum = _run(run_cli, tmp_path / "accum", *rm, "train.grad_accum_steps=2")
    keys = ("loss", "grad_norm", "accuracy", "margin")
    _same_update(whole, accum, keys)
    for budget, packed, counts, oversize in _packed_like(run_cli, tmp_path, spied, rm, whole,
                                                         keys, (100, 29)):
        assert len(counts) > 1 and (len(set(counts)) > 1 or oversize), counts
        assert oversize == (budget == 29)
        assert packed[0]["batch/micro_batches"] == len(counts)


def test_dpo_reference_scores_the_micro_batches_the_policy_trains_on(run_cli, tmp_path, spied):
    """DPO packs its step once for the reference and once for the policy, alike; with
    ``logprob_max_tokens_per_microbatch`` the reference packs by that budget instead. The
    update is the one micro-batch's."""
    dpo = ("recipes/dpo-arith.toml", "algo.pairs_per_step=8")
    keys = ("loss", "grad_norm", "chosen_logprob", "rejected_logprob")
    whole = _run(run_cli, tmp_path / "whole", *dpo)
    packed = _run(run_cli, tmp_path / "packed", *dpo, "train.max_tokens_per_microbatch=100")
    _same_update(packed, whole, keys)
    assert len(spied) == 2 and spied[0] == spied[1]
    assert packed[0]["batch/micro_batches"] == len(spied[0][2]) > 1
    spied.clear()
    scored = _run(run_cli, tmp_path / "scored", *dpo, "train.max_tokens_per_microbatch=100",
                  "train.logprob_max_tokens_per_microbatch=60")
    _same_update(scored, whole, keys)
    [(_, b1, ref), (_, b2, upd)] = spied
    assert (b1, b2) == (60, 100) and len(ref) > len(upd) > 1


def test_grpo_packed_by_tokens_updates_as_the_accumulated_steps(run_cli, tmp_path, spied):
    """GRPO packs each of its optimizer steps' minibatches (two per step, two epochs: four)
    by the rows' prompt and completion tokens. Budgets 50 (several rows a micro-batch, unevenly)
    and 8 (every row over it, each alone) update as one micro-batch per minibatch and as
    ``grad_accum_steps = 4``: loss, gradient norm and weights to 1e-12."""
    grpo = ("recipes/grpo-arith.toml", "algo.prompts_per_step=4", "algo.group_size=4",
            "algo.minibatches=2", "algo.ppo_epochs=2", "algo.old_logprobs=policy")
    whole = _run(run_cli, tmp_path / "whole", *grpo)
    accum = _run(run_cli, tmp_path / "accum", *grpo, "train.grad_accum_steps=4")
    keys = ("loss", "grad_norm")
    _same_update(whole, accum, keys)
    for budget in (50, 8):
        spied.clear()
        packed = _run(run_cli, tmp_path / f"b{budget}", *grpo,
                      f"train.max_tokens_per_microbatch={budget}")
        _same_update(packed, whole, keys)
        # a share of tokens, summed in float32 whatever the model's dtype
        assert packed[0]["clip_frac"] == pytest.approx(whole[0]["clip_frac"], rel=1e-6)
        used = _budgets_used(spied)
        assert len(used) == 4  # one packing per optimizer step
        counts = [c for c, _ in used]
        assert all(sum(c) == 8 for c in counts)  # each minibatch: 8 of the 16 rows
        if budget == 8:
            assert all(c == [1] * 8 and oversize for c, oversize in used)
        else:
            assert any(len(set(c)) > 1 for c in counts) and not any(o for _, o in used), used
        assert packed[0]["batch/micro_batches"] == sum(len(c) for c in counts) / 4


def _budget_runs(run_cli, tmp_path, spied, recipe, keys):
    """A run packed by ``train.max_tokens_per_microbatch = 40`` and one whose scoring passes
    are packed by ``train.logprob_max_tokens_per_microbatch = 30``, each updating as the run of
    one micro-batch (``keys``, weights to 1e-12); returns the packings each made."""
    whole = _run(run_cli, tmp_path / "whole", *recipe)
    made = {}
    for name, key in (("update", "train.max_tokens_per_microbatch=40"),
                      ("scoring", "train.logprob_max_tokens_per_microbatch=30")):
        spied.clear()
        _same_update(_run(run_cli, tmp_path / name, *recipe, key), whole, keys)
        made[name] = list(spied)
    return made


def _several_rows_and_one_alone(packings, budget, rows):
    for lengths, b, pieces in packings:
        assert b == budget and sorted(i for p in pieces for i in p) == list(range(rows))
        assert 1 < len(pieces) < rows, pieces  # rows shared a micro-batch, and not all did
        assert all(len(p) == 1 or sum(lengths[i] for i in p) <= budget for p in pieces)


def test_ppo_packed_by_tokens_updates_as_the_whole_step(run_cli, tmp_path, spied):
    """PPO packs each optimizer step's minibatch of the policy and critic update (two epochs of
    two minibatches: four packings of 8 of the 16 rows), and its scoring passes (the policy's
    behaviour logprobs, the reference's, the critic's values: three packings of all 16 rows):
    the update is the one micro-batch's, losses and gradient norm to 1e-12 relative."""
    ppo = ("recipes/ppo-arith.toml", "algo.prompts_per_step=8", "algo.samples_per_prompt=2")
    made = _budget_runs(run_cli, tmp_path, spied, ppo, ("loss", "grad_norm", "value_loss"))
    assert len(made["update"]) == 4
    _several_rows_and_one_alone(made["update"], 40, 8)
    assert len(made["scoring"]) == 3
    _several_rows_and_one_alone(made["scoring"], 30, 16)


def test_opd_packed_by_tokens_updates_as_the_whole_step(run_cli, tmp_path, spied):
    """OPD packs the whole batch for each epoch's optimizer step, and its scoring passes (the
    teacher's logprobs of the sampled tokens, the behaviour logprobs of the second epoch)."""
    opd = ("recipes/opd-arith.toml", "algo.prompts_per_step=8", "algo.full_kl=false",
           "algo.ppo_epochs=2")
    made = _budget_runs(run_cli, tmp_path, spied, opd, ("loss", "grad_norm"))
    assert len(made["update"]) == 2
    _several_rows_and_one_alone(made["update"], 40, 16)
    assert len(made["scoring"]) == 2
    _several_rows_and_one_alone(made["scoring"], 30, 16)


def test_grpo_scoring_passes_packed_by_tokens(run_cli, tmp_path, spied):
    """GRPO's scoring passes: the reference (``kl_beta``) over all 16 rows and, with two
    minibatches, the behaviour logprobs of the 8 rows the first optimizer step does not score
    itself; the update is the unpacked run's."""
    grpo = ("recipes/grpo-arith.toml", "algo.prompts_per_step=4", "algo.group_size=4",
            "algo.minibatches=2", "algo.old_logprobs=policy", "algo.kl_beta=0.05")
    whole = _run(run_cli, tmp_path / "whole", *grpo)
    scored = _run(run_cli, tmp_path / "scored", *grpo, "train.logprob_max_tokens_per_microbatch=30")
    _same_update(scored, whole, ("loss", "grad_norm", "kl"))
    [(old_lengths, _, old), (_, _, ref)] = spied
    assert len(old_lengths) == 8 and len(ref) > len(old) > 1


class _Forwards:
    """A scoring forward that records its rows and gives each row's value ``10 * row + column``
    up to the piece's longest row (``width`` columns per row)."""

    def __init__(self, width):
        self.width, self.calls = width, []

    def __call__(self, rows):
        self.calls.append(list(rows))
        w = max(self.width[r] for r in rows)
        return torch.tensor([[10.0 * r + c for c in range(w)] for r in rows])


def test_scoring_passes_land_on_the_grid_and_ranks_run_equally_many():
    """Rows 0-3 of 5, 8, 3, 4 tokens within 8: three passes ([1], [0, 2], [3]) each written
    at its rows, zeros past a piece's width and in row 4 (not scored); the other rank runs 5,
    so this one runs two dropped fillers on row 0. One pass without a budget, no gather."""
    forward = _Forwards({0: 2, 1: 3, 2: 1, 3: 2})
    grid, count = batches.scored_by_tokens(_TwoRanks(5), 8, range(4), [5, 8, 3, 4, 9], (5, 3),
                                           forward)
    assert forward.calls == [[1], [0, 2], [3], [0], [0]] and count == 5
    assert grid.tolist() == [[0, 1, 0], [10, 11, 12], [20, 21, 0], [30, 31, 0], [0, 0, 0]]
    forward = _Forwards({0: 2, 1: 3, 2: 1, 3: 2})
    grid, count = batches.scored_by_tokens(SimpleNamespace(world=2, gather=None), 0, [2, 0],
                                           [5, 8, 3, 4], (4, 3), forward)
    assert forward.calls == [[2, 0]] and count == 1
    assert grid.tolist() == [[0, 1, 0], [0, 0, 0], [20, 21, 0], [0, 0, 0]]


# --- refusals and the dry run -----------------------------------------------------------------


@pytest.mark.parametrize(("recipe", "overrides", "message"), [
    ("recipes/sft-arith.toml", ["train.grad_accum_steps=2"],
     "train.max_tokens_per_microbatch: train.max_tokens_per_microbatch and "
     "train.grad_accum_steps > 1 are mutually exclusive (got 64)."),
    ("recipes/grpo-arith.toml", ["train.grad_accum_steps=2"],
     "train.max_tokens_per_microbatch: train.max_tokens_per_microbatch and "
     "train.grad_accum_steps > 1 are mutually exclusive (got 64)."),
    ("recipes/sft-arith.toml", ["train.logprob_max_tokens_per_microbatch=32"],
     "train.logprob_max_tokens_per_microbatch: algo.kind = 'sft' runs no scoring pass (got 32)."),
    ("recipes/rm-arith.toml", ["train.logprob_max_tokens_per_microbatch=32"],
     "train.logprob_max_tokens_per_microbatch: algo.kind = 'rm' runs no scoring pass (got 32)."),
    ("recipes/ppo-arith.toml", ["train.logprob_max_tokens_per_microbatch=-2"],
     "train.logprob_max_tokens_per_microbatch: must be >= 0 (0: off) (got -2)."),
    ("recipes/dpo-arith.toml", ["train.max_tokens_per_microbatch=-1"],
     "train.max_tokens_per_microbatch: must be >= 0 (0: off) (got -1)."),
])
def test_refusals_are_one_line(recipe, overrides, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / recipe, ["train.max_tokens_per_microbatch=64", *overrides])
    assert len(info.value.problems) == 1, str(info.value)
    text = str(info.value).strip()
    assert "\n" not in text and message in text, text


def test_dry_run_shows_the_budget(run_cli):
    rc, out, err = run_cli("--plain", "--dry-run", "recipes/rm-arith.toml",
                           "train.max_tokens_per_microbatch=256")
    assert rc == 0, err
    assert "up to 256 tokens each, packed best-fit" in out
    assert "per optimizer step" not in out and "scoring passes" not in out
    # 64 rows per rank of at most 40 tokens within 100: every micro-batch but the last holds
    # more than 60, so at most 64 * 40 // 61 + 1 = 42
    rc, out, err = run_cli("--plain", "--dry-run", "recipes/grpo-arith.toml",
                           "train.max_tokens_per_microbatch=100", "rollout.max_model_len=40",
                           "train.logprob_max_tokens_per_microbatch=512")
    assert rc == 0, err
    assert "at most 42 per optimizer step" in out, out
    assert "up to 512 tokens each" in out


def test_dry_run_shows_how_sft_conversations_pack(run_cli):
    """SFT's dry run packs one rank's first step of conversations (the source's first 32) and
    shows the share of the budget their tokens fill."""
    import math
    import re

    from runner.data.conversations import conversation_of
    from runner.data.sources import build_prompt_sources
    from runner.models import resolve_model_path
    from runner.packers.decoder_only import DecoderOnlyLLMDataPacker

    rc, out, err = run_cli("--plain", "--dry-run", "recipes/sft-arith.toml",
                           "train.max_tokens_per_microbatch=256")
    assert rc == 0, err
    text = " ".join(re.sub(r"[│|]", " ", out).split())
    found = re.search(r"first 32 conversations \(one rank's step\): (\d+) micro-batch\(es\) "
                      r"of up to 256 tokens, (\d+)% of the budget filled", text)
    assert found, text
    recipe = load_recipe(REPO / "recipes/sft-arith.toml")
    packer = DecoderOnlyLLMDataPacker()
    packer.setup(str(resolve_model_path(recipe.model.path)))
    train, _ = build_prompt_sources(recipe.data, "sft")
    total = sum(len(packer.get_conversation_input(conversation_of(train.item(i)),
                                                  "assistant").input_ids) for i in range(32))
    count = int(found[1])
    assert count >= math.ceil(total / 256) and int(found[2]) == round(100 * total / (count * 256))
    rc, out, err = run_cli("--plain", "--dry-run", "recipes/rm-arith.toml")
    assert rc == 0, err
    assert "packed best-fit" not in out
