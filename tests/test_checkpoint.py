"""Atomic, pickle-free checkpoints: layout, round trip, pruning, and crash safety."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from runner.errors import RuntimeFailure
from runner.state.checkpoint import WholeState, save_checkpoint
from runner.state.layout import COMPLETE, TrainingState, complete_checkpoints, restore_rng
from runner.state.load import latest_checkpoint, load_checkpoint


@pytest.fixture
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg)


def _trained_optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    loss = model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss
    loss.backward()
    opt.step()
    return opt


def _save(root, step, model, opt, keep_last=2):
    state = TrainingState(step=step, cursor={"cursor": {"epoch": 0}},
                          scheduler={"last_epoch": step})
    rows = [{"step": s, "loss": 0.5 * s} for s in range(1, step + 1)]
    return save_checkpoint(root, step, policy=WholeState(model, opt), tokenizer=None,
                           state=state, metrics_rows=rows, keep_last=keep_last)


def test_round_trip_is_bitwise(tmp_path, model):
    opt = _trained_optimizer(model)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = _save(tmp_path, 3, model, opt)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    ckpt = load_checkpoint(path)
    restore_rng(ckpt.rng_of_rank(0), ckpt.rng_tensors_of_rank(0))
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])
    reloaded = Qwen2ForCausalLM.from_pretrained(ckpt.model_dir)
    for (n, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(),
                              strict=True):
        assert torch.equal(a, b), n
    opt2 = torch.optim.AdamW(reloaded.parameters(), lr=1e-2, foreach=False)
    opt2.load_state_dict(ckpt.optimizer_state)
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd1["param_groups"] == sd2["param_groups"] and sd1["state"].keys() == sd2["state"].keys()
    for index, slots in sd1["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(slots[name], sd2["state"][index][name]), (index, name)
    assert ckpt.state.step == 3 and ckpt.state.scheduler == {"last_epoch": 3}
    assert [r["step"] for r in ckpt.metrics_rows] == [1, 2, 3]


def test_no_pickle_files(tmp_path, model):
    path = _save(tmp_path, 1, model, _trained_optimizer(model))
    suffixes = {p.suffix for p in path.rglob("*") if p.is_file()}
    assert ".bin" not in suffixes and ".pt" not in suffixes and ".pkl" not in suffixes
    assert (path / COMPLETE).is_file() and (path / "model" / "model.safetensors").is_file()


def test_keep_last_and_latest_pointer(tmp_path, model):
    opt = _trained_optimizer(model)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, opt, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    assert (tmp_path / "latest").read_text() == "step-000004"
    assert latest_checkpoint(tmp_path).name == "step-000004"


def test_half_written_checkpoint_is_ignored_and_cleaned(tmp_path, model):
    opt = _trained_optimizer(model)
    _save(tmp_path, 1, model, opt)
    # A crash mid-write leaves a temporary folder and maybe a step folder without COMPLETE.
    (tmp_path / ".tmp-step-000002-999").mkdir()
    (tmp_path / "step-000003").mkdir()
    (tmp_path / "latest").write_text("step-000003")
    assert latest_checkpoint(tmp_path).name == "step-000001"
    _save(tmp_path, 2, model, opt)
    assert not (tmp_path / ".tmp-step-000002-999").exists()
    assert latest_checkpoint(tmp_path).name == "step-000002"


def test_failure_while_writing_leaves_earlier_checkpoint(tmp_path, model, monkeypatch):
    opt = _trained_optimizer(model)
    first = _save(tmp_path, 1, model, opt)
    before = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()}

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("runner.state.checkpoint.save_file", explode)
    with pytest.raises(RuntimeFailure, match=r"^policy at step 2: cannot write checkpoint .*"
                       r"step-000002 \(optimizer.safetensors\): OSError: disk full; the "
                       r"partial checkpoint was removed"):
        _save(tmp_path, 2, model, opt)
    after = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()}
    assert before == after
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]
    assert latest_checkpoint(tmp_path) == first
