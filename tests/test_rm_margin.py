"""Reward models with a per-pair margin (``data.margin_column``): the loss and its gradient by
hand, margins from a jsonl file into the loss (training and held-out), the fingerprint, and the
refusals, each one exact line."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

import runner.train.loops.rm as rm_loop
from runner.algorithms.rm import rm_loss
from runner.data.cursor import diff_parts
from runner.data.preference import DatasetPreferenceEnv, PreferencePair, build_pair_source
from runner.errors import ExtensionError, RecipeError, ResumeError
from runner.recipe import load_recipe
from runner.recipe.schema import DataConfig, ValidationConfig
from runner.train.loops.rm import PackedPairs, given_margins
from tests.conftest import REPO
from tests.resume_helpers import rows
from tests.test_rm import by_hand as bt_by_hand

HERE = __name__
OFF = ValidationConfig(enabled=False)
CHOSEN = [0.3, -1.2, 2.0]
REJECTED = [0.1, 0.4, -0.7]
GIVEN = [0.5, -1.0, 3.25]  # the third pair ranked right but by less than its margin


def by_hand(center: float) -> tuple[float, list[float], list[float]]:
    """The Bradley-Terry loss and its gradients written out per pair (``tests.test_rm``), with
    these pairs' given margins."""
    return bt_by_hand(center, CHOSEN, REJECTED, GIVEN)


@pytest.mark.parametrize("center", [0.0, 0.25])
def test_margin_loss_and_gradient_by_hand(center):
    chosen = torch.tensor(CHOSEN, dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor(REJECTED, dtype=torch.float64, requires_grad=True)
    loss, metrics = rm_loss(chosen, rejected, center, torch.tensor(GIVEN, dtype=torch.float64))
    loss.backward()
    want, d_c, d_r = by_hand(center)
    assert abs(loss.item() - want) < 1e-12
    assert max(abs(a - b) for a, b in zip(chosen.grad.tolist(), d_c, strict=True)) < 1e-12
    assert max(abs(a - b) for a, b in zip(rejected.grad.tolist(), d_r, strict=True)) < 1e-12
    # accuracy and margin are about the scores alone: the given margins are not subtracted
    assert metrics["accuracy"].item() == 2 / 3
    scored = [c - r for c, r in zip(CHOSEN, REJECTED, strict=True)]
    assert abs(metrics["margin"].item() - sum(scored) / 3) < 1e-12
    plain, _ = rm_loss(chosen.detach(), rejected.detach(), center)
    zeros, _ = rm_loss(chosen.detach(), rejected.detach(), center, torch.zeros(3))
    assert plain.item() == zeros.item()  # no margin column: the loss of before


def test_packed_pairs_give_the_margins_of_the_rows_asked_for():
    pairs = tuple(PreferencePair(f"p{i}", "a", "b", f"train-{i}", margin=i + 0.5)
                  for i in range(4))
    packed = PackedPairs((), given_margins(pairs))
    assert packed.margins(torch.tensor([2, 0, 3])).tolist() == [2.5, 0.5, 3.5]


def write_jsonl(path: Path, items) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return str(path)


def pairs_file(path: Path, count: int, first: int, sign: float = 1.0) -> str:
    """``count`` arithmetic pairs, each with its own margin under "gap"."""
    return write_jsonl(path, [{"prompt": f"What is {a} + 1?", "chosen": str(a + 1),
                               "rejected": str(a + 2), "gap": sign * (a + 0.25)}
                              for a in range(first, first + count)])


def test_a_jsonl_margin_column_reaches_the_loss(tmp_path, run_cli, monkeypatch):
    """One step from a jsonl file with margins: the step's loss is computed with the margins of
    the pairs it drew, and the held-out loss with those of the held-out file, every one once."""
    train = pairs_file(tmp_path / "train.jsonl", 8, 0)
    held = pairs_file(tmp_path / "held.jsonl", 4, 100, sign=-1.0)
    calls: list[tuple[list[float], float, float]] = []
    real = rm_loop.rm_loss

    def recording(chosen, rejected, center_coef=0.0, given_B=None):
        loss, metrics = real(chosen, rejected, center_coef, given_B)
        want = -torch.nn.functional.logsigmoid(chosen - rejected - given_B.to(chosen)).mean()
        calls.append((given_B.tolist(), loss.item(), want.item()))
        return loss, metrics

    monkeypatch.setattr(rm_loop, "rm_loss", recording)
    out = tmp_path / "run"
    rc, stdout, stderr = run_cli(
        "recipes/rm-arith.toml", "--plain", f"run.output_dir={out}", "run.max_steps=1",
        "data.synthetic_pairs=0", f"data.jsonl_path={train}", "data.margin_column=gap",
        f"data.validation.jsonl_path={held}", "algo.pairs_per_step=4", "train.eval_every=1",
        "logging.sample_every=0")
    assert rc == 0, stdout + stderr
    trained = [c for c in calls if c[0] and c[0][0] > 0]
    evaluated = [c for c in calls if c[0] and c[0][0] < 0]
    assert len(trained) == 1 and len(trained[0][0]) == 4
    assert set(trained[0][0]) <= {a + 0.25 for a in range(8)}
    assert len(set(trained[0][0])) == 4
    assert evaluated and all(sorted(c[0]) == sorted(-(a + 0.25) for a in range(100, 104))
                             for c in evaluated)  # every pass: each held-out pair once
    assert all(abs(loss - want) < 1e-6 for _, loss, want in calls)
    last = rows(out)[-1]
    assert last["step"] == 1 and last["loss"] == pytest.approx(trained[0][1], abs=1e-6)
    assert last["eval/loss"] == pytest.approx(evaluated[-1][1], abs=1e-6)


def test_margins_travel_with_their_pairs_and_into_the_fingerprint(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}", "chosen": "a", "rejected": "b",
                                               "gap": i * 1.5, "other": -i} for i in range(6)])
    d = DataConfig(jsonl_path=path, margin_column="gap", validation=OFF)
    env = DatasetPreferenceEnv(d, seed=0, rank=1, world=2)
    batch = env.next_batch(3)
    assert [p.margin for p in batch] == [int(p.prompt[1:]) * 1.5 for p in batch]
    plain = build_pair_source(DataConfig(jsonl_path=path, validation=OFF))
    assert plain.pair(1).margin == 0.0 and "margin" not in plain.fingerprint_parts()["keys"]
    other = DataConfig(jsonl_path=path, margin_column="other", validation=OFF)
    assert env.fingerprint_parts()["keys"].endswith(" margin=gap")
    changed = diff_parts(env.fingerprint_parts(), build_pair_source(other).fingerprint_parts())
    assert [line.split()[0] for line in changed] == ["keys"]  # the column alone differs
    with pytest.raises(ResumeError, match="the data cursor does not fit this data"):
        DatasetPreferenceEnv(other, seed=0, rank=1, world=2, cursor=env.cursor)
    resumed = DatasetPreferenceEnv(d, seed=0, rank=1, world=2, cursor=env.cursor)
    assert resumed.next_batch(2) == env.next_batch(2)


def test_tar_and_factory_pairs_carry_margins(tmp_path):
    path = tmp_path / "p.tar"
    with tarfile.open(path, "w") as archive:
        for i in range(2):
            data = json.dumps({"prompt": f"p{i}", "chosen": "a", "rejected": "b", "gap": i + 2})
            info = tarfile.TarInfo(f"{i}.json")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data.encode()))
    src = build_pair_source(DataConfig(tar_path=str(path), margin_column="gap", validation=OFF))
    assert [src.pair(i).margin for i in range(2)] == [2.0, 3.0]
    src = build_pair_source(DataConfig(factory=f"{HERE}.mapped", margin_column="gap",
                                       validation=OFF))
    assert src.pair(1) == PreferencePair("p1", "a", "b", "train-1", margin=-1.0)
    assert "margin=gap" in src.fingerprint_parts()["keys"]


def mapped():
    return [{"prompt": f"p{i}", "chosen": "a", "rejected": "b", "gap": -float(i)}
            for i in range(3)]


def triples():
    return [("p0", "a", "b")]


# --- refusals, each one exact line -------------------------------------------------------------

@pytest.mark.parametrize(("value", "why"), [
    (None, "no 'gap' key (its keys: 'prompt', 'chosen', 'rejected'). Set data.margin_column to "
           "the right key."),
    ("1.5", "the margin 'gap' is text, not a number (got '1.5'). Write the margin as a JSON "
            "number."),
    (True, "the margin 'gap' is a boolean, not a number (got True). Write the margin as a JSON "
           "number."),
    ([1], "the margin 'gap' is a list, not a number (got [1]). Write the margin as a JSON "
          "number."),
    (float("inf"), "the margin 'gap' is not a finite number (got inf). Give every pair a "
                   "finite margin."),
    (float("nan"), "the margin 'gap' is not a finite number (got nan). Give every pair a "
                   "finite margin."),
])
def test_a_bad_margin_names_the_file_line_and_field(tmp_path, value, why):
    bad = {"prompt": "q", "chosen": "a", "rejected": "b"}
    if value is not None:
        bad["gap"] = value
    path = write_jsonl(tmp_path / "p.jsonl", [{**bad, "gap": 1}, bad])
    with pytest.raises(RecipeError) as info:
        build_pair_source(DataConfig(jsonl_path=path, margin_column="gap", validation=OFF))
    assert str(info.value) == f"data.jsonl_path: {path} line 2: {why}"


def test_held_out_pairs_need_their_margins_too(tmp_path):
    train = pairs_file(tmp_path / "train.jsonl", 4, 0)
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    d = DataConfig(jsonl_path=train, margin_column="gap",
                   validation=ValidationConfig(jsonl_path=held))
    with pytest.raises(RecipeError) as info:
        DatasetPreferenceEnv(d, seed=0)
    assert str(info.value) == (f"data.validation.jsonl_path: {held} line 1: no 'gap' key (its "
                               "keys: 'prompt', 'chosen', 'rejected'). Set data.margin_column to "
                               "the right key.")


def test_a_factory_of_triples_has_no_margin_field():
    src = build_pair_source(DataConfig(factory=f"{HERE}.triples", margin_column="gap",
                                       validation=OFF))
    with pytest.raises(ExtensionError) as info:
        src.pair(0)
    assert str(info.value) == (f"data.factory: {HERE}.triples: item 0 is a tuple, not a mapping "
                               "with the margin field 'gap' (data.margin_column). Return each "
                               "pair as a dict with the keys of a jsonl sample.")


@pytest.mark.parametrize(("recipe", "overrides", "line"), [
    ("recipes/rm-arith.toml", [], "command line: data.margin_column: the built-in arithmetic "
     "pairs (data.synthetic_pairs) carry no margins (got 'gap'). Give the pairs with their "
     "margins as data.jsonl_path, data.tar_path or data.factory, or remove data.margin_column."),
    ("recipes/dpo-arith.toml", [], "command line: data.margin_column: only used by "
     "RM, but algo.kind is 'dpo' (got 'gap'). Remove the key."),
    ("recipes/grpo-arith.toml", [], "command line: data.margin_column: only used by RM, but "
     "algo.kind is 'grpo' (got 'gap'). Remove the key."),
])
def test_margin_column_is_refused_where_no_margin_is_read(recipe, overrides, line):
    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / recipe, [*overrides, "data.margin_column=gap"])
    assert str(info.value) == line
