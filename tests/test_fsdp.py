"""``train.sharding = "fsdp"`` (FSDP2 per transformer block, torchrun ranks, gloo on 127.0.0.1).

- 2 sharded ranks and 2 DDP ranks train the same GRPO, DPO (the reference sharded too, one
  held-out pair over two ranks) and LoRA run: in float64 their weights agree to 1e-10 relative
  after every step (only the order of float additions differs); the float32 first step is
  compared in tests/test_torchrun.py;
- a checkpoint's model folder is one consolidated Hugging Face folder (from_pretrained loads it)
  and its optimizer state one safetensors file per rank, listed in the manifest; a truncated
  shard makes the resume fall back to the checkpoint before; 2 -> 1 -> 2 ranks continue;
- a job SIGKILLed after a checkpoint resumes bitwise like the uninterrupted sharded run, and
  the resume unpickles nothing (a guard in every process of it records any unpickling of a file);
- PPO shards its critic as the policy: 2 sharded and 2 DDP ranks agree in float64 on both models
  after every step, the critic is gathered into ``extra_models/critic/`` and its optimizer
  written per rank, and a resume from a checkpoint is bitwise, unpickling nothing;
- LoRA on a sharded base: only the adapters train and are saved (agreeing with DDP in float64),
  the engine gets the merged weights;
- the recipe checks refuse what fsdp does not support yet.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import attrs
import pytest
import torch

from runner.errors import RecipeError, RunnerError, RuntimeFailure
from runner.recipe import load_recipe
from runner.state.layout import step_dirname
from tests.conftest import REPO
from tests.multiproc import item_ids, run_ranks, start_ranks
from tests.resume_helpers import (
    CLI,
    _env,
    assert_same_run,
    deterministic_rows,
    final_weights,
    wait_for_checkpoint,
)

GRPO = "recipes/grpo-arith.toml"
N = 3
# Padded batches in float64, as tests/test_torchrun.py compares world sizes (RMSNorm computes in
# float32 whatever the dtype; padding-free layouts would share prompts within micro-batches).
# Two micro-batches per optimizer step: the first backward runs with gradient sync off.
RUN = (f"run.max_steps={N}", "algo.prompts_per_step=4", "algo.group_size=4",
       "algo.minibatches=2", "train.grad_accum_steps=2", "rollout.max_new_tokens=4",
       "data.validation.size=8", "train.eval_every=3", "checkpoint.every_steps=1",
       "checkpoint.keep_last=5", "logging.sample_every=0", "logging.item_ids=true",
       "algo.kl_beta=0.1",  # a reference, sharded with the policy under fsdp
       "model.dtype=float64", "train.padding_free=false")
FSDP = "train.sharding=fsdp"
SHARDS = ("optimizer-rank-00000-of-00002.safetensors", "optimizer-rank-00001-of-00002.safetensors")
FILES = ("model/model.safetensors", *SHARDS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _worst_rel(got: dict, want: dict) -> float:
    """The largest relative difference of ``got``'s tensors from ``want``'s (non-zero) ones."""
    return max(_rel(got[k], want[k]) for k in want if want[k].norm() > 0)


def both_layouts(root, recipe: str, overrides: tuple[str, ...]) -> dict:
    """``{"none": folder, "fsdp": folder}``: ``recipe`` with ``overrides`` on 2 ranks each way."""
    made = {}
    for sharding in ("none", "fsdp"):
        out = root / sharding
        done = run_ranks(recipe, out, 2, *overrides, f"train.sharding={sharding}")
        assert done.returncode == 0, done.stdout + done.stderr
        made[sharding] = out
    return made


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"none": folder, "fsdp": folder}``: the same 3 float64 steps on 2 ranks each way."""
    return both_layouts(tmp_path_factory.mktemp("fsdp"), GRPO, RUN)


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp_and_ddp_agree_in_float64(runs):
    ddp, fsdp = runs["none"], runs["fsdp"]
    assert item_ids(ddp) == item_ids(fsdp) and len(item_ids(fsdp)) == N
    rows = {name: [r for r in deterministic_rows(out) if "loss" in r]
            for name, out in runs.items()}
    assert len(rows["fsdp"]) == N
    for a, b in zip(rows["none"], rows["fsdp"], strict=True):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * a["grad_norm"]  # the whole model's
        assert a["reward/mean"] == b["reward/mean"]
    for step in range(1, N + 1):
        one, two = final_weights(ddp, step), final_weights(fsdp, step)
        assert one.keys() == two.keys()  # the tied LM head is not written twice
        assert all(t.dtype == torch.float64 for t in two.values())
        worst = _worst_rel(two, one)
        assert worst < 1e-10, (step, worst)
    start, end = final_weights(fsdp, 1), final_weights(fsdp, N)
    assert any(not torch.equal(start[k], end[k]) for k in start)  # training moved the weights


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp_checkpoint_layout(runs):
    """The optimizer state is one safetensors file per rank (each holding its half of every
    sharded slot), indexed by optimizer.json and covered by the manifest; nothing pickled."""
    from safetensors import safe_open

    folder = runs["fsdp"] / "checkpoints" / step_dirname(N)
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert set(SHARDS) <= files and "optimizer.safetensors" not in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))], files
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert set(SHARDS) <= manifest["files"].keys()
    index = json.loads((folder / "optimizer.json").read_text())
    assert index["files"] == list(SHARDS)
    handles = [safe_open(folder / f, "pt") for f in SHARDS]
    full = final_weights(runs["fsdp"], N)
    for key, slots in index["state"].items():
        param = index["params"][key]
        assert param["shape"] == list(full[param["name"]].shape)
        assert slots["exp_avg"] == "shard0"
        halves = [h.get_tensor(f"{key}.exp_avg") for h in handles]
        assert sum(h.shape[0] for h in halves) == param["shape"][0]
        assert all(h.shape[0] < param["shape"][0] for h in halves if param["shape"][0] > 1)


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp_model_folder_loads_with_transformers(runs):
    from transformers import AutoModelForCausalLM

    folder = runs["fsdp"] / "checkpoints" / step_dirname(N) / "model"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    saved = final_weights(runs["fsdp"], N)
    ddp = final_weights(runs["none"], N)
    params = dict(model.named_parameters())
    assert params.keys() == saved.keys()
    for name, p in params.items():
        assert torch.equal(p.detach(), saved[name]), name
        assert _rel(p.detach(), ddp[name]) < 1e-10 or ddp[name].norm() == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


@pytest.mark.parametrize("recipe, role, overrides", [
    ("grpo-arith", "reference", ("algo.kl_beta=0.1",)),
    ("dpo-arith", "reference", ()),
    ("opd-arith", "teacher", ()),  # one tokenizer: the teacher scores the student's batches
])
def test_frozen_models_are_sharded_under_fsdp(tmp_path, recipe, role, overrides):
    """The frozen reference (GRPO, DPO) and OPD's same-tokenizer teacher are sharded with the
    policy; the float64 comparisons with DDP (``runs``, the DPO and OPD ones) check they score
    the same."""
    from torch.distributed.tensor import DTensor

    from tests.tiny_run import tiny_run

    with tiny_run(recipe, tmp_path, FSDP, *overrides) as run:
        frozen = getattr(run.roles, role)
        model = frozen.frozen.model if role == "teacher" else frozen.model
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert run.svc.plan.rows()[1][1].endswith(f"policy and {role} sharded (FSDP2)")


def test_a_teacher_of_another_tokenizer_stays_whole():
    from runner.recipe.plan import make_plan

    recipe = load_recipe(REPO / "recipes/opd-cross-tokenizer.toml", [FSDP])
    assert "teacher" not in make_plan(recipe).sharded
    assert "policy" in make_plan(recipe).sharded


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp_bf16_keeps_fp32_master_weights(tmp_path):
    """Under ``train.precision = "bf16"`` the blocks compute in bf16 (MixedPrecisionPolicy), but
    the weights and the optimizer state stay float32: that is what the checkpoint holds."""
    from safetensors.torch import load_file

    done = run_ranks(GRPO, tmp_path, 2, *RUN[1:-2], "run.max_steps=1", FSDP,
                     "train.precision=bf16")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [r for r in deterministic_rows(tmp_path) if "loss" in r]
    assert len(rows) == 1 and rows[0]["grad_norm"] > 0
    folder = tmp_path / "checkpoints" / step_dirname(1)
    assert {t.dtype for t in final_weights(tmp_path, 1).values()} == {torch.float32}
    for shard in SHARDS:
        assert {t.dtype for t in load_file(folder / shard).values()} == {torch.float32}


def _guard_env(tmp_path) -> tuple[dict[str, str], object]:
    """An environment whose every Python process records each file it unpickles in the log
    returned (tests/unpickle_guard/sitecustomize.py)."""
    log = tmp_path / "unpickled.log"
    env = {**_env(), "PYTHONPATH": f"{REPO / 'tests' / 'unpickle_guard'}{os.pathsep}{REPO}",
           "FSDP_TEST_UNPICKLE_LOG": str(log)}
    return env, log


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp_sigkill_after_a_checkpoint_resumes_bitwise_unpickling_nothing(runs, tmp_path):
    """The whole job (driver and ranks) is SIGKILLed once checkpoint 1 is complete; the rerun
    resumes from it and ends bitwise like the uninterrupted sharded run (metrics, state, weights
    and every rank's optimizer shard), with no file unpickled by any of its processes."""
    out = tmp_path / "run"
    proc = start_ranks(GRPO, out, 2, *RUN, FSDP)
    wait_for_checkpoint(proc, out, 1)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(0.5)
    env, log = _guard_env(tmp_path)
    done = subprocess.run([*CLI, GRPO, f"run.output_dir={out}", "launch.backend=torchrun",
                           "launch.num_processes=2", *RUN, FSDP], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = [line for line in done.stdout.splitlines() if line.startswith("resuming")]
    assert len(resumed) == 1 and f"(step {N})" not in resumed[0], done.stdout  # mid-run
    lines = log.read_text().splitlines()
    assert len([line for line in lines if line.startswith("guarded ")]) >= 3  # driver + 2 ranks
    assert [line for line in lines if not line.startswith("guarded ")] == [], log.read_text()
    assert_same_run(out, runs["fsdp"], N, FILES)


def _rewind(src, dst, step: int, last: int = N) -> None:
    """``dst``: a copy of the run folder ``src`` (of ``last`` steps) whose newest checkpoint is
    ``step``."""
    shutil.copytree(src, dst)
    root = dst / "checkpoints"
    for later in range(step + 1, last + 1):
        shutil.rmtree(root / step_dirname(later))
    (root / "latest").write_text(step_dirname(step))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("written, world, sharding", [
    ("fsdp", 2, "none"),  # the shards put together for DDP's whole optimizer
    ("none", 2, "fsdp"),  # DDP's whole optimizer state cut into shards
])
def test_resume_across_world_size_and_sharding(runs, tmp_path, written, world, sharding):
    """2 steps written by 2 ranks (``written``), the third on ``world`` ranks with
    ``sharding``: the same items and, in float64, the straight run's weights to 1e-10."""
    out = tmp_path / "run"
    _rewind(runs[written], out, 2)
    done = run_ranks(GRPO, out, world, *RUN, f"train.sharding={sharding}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(step 2)" in done.stdout
    assert item_ids(out) == item_ids(runs[written])
    one, two = final_weights(out, N), final_weights(runs[written], N)
    assert _worst_rel(one, two) < 1e-10


@pytest.mark.slow
@pytest.mark.multiproc
def test_sharded_resume_from_two_ranks_to_one_and_back(runs, tmp_path):
    """Checkpoint 2 of 2 sharded ranks has a truncated optimizer shard: the rerun on 1 rank
    falls back to checkpoint 1 saying why and runs step 2 (the two optimizer shards put
    together and cut for one rank: one shard file); step 3 runs on 2 ranks again (the one shard
    cut in two). The same items as the straight run and, in float64, its weights to 1e-10."""
    out = tmp_path / "run"
    _rewind(runs["fsdp"], out, 2)
    shard = out / "checkpoints" / step_dirname(2) / SHARDS[1]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    done = run_ranks(GRPO, out, 1, *RUN, FSDP, "run.max_steps=2")  # a constant LR: unchanged
    assert done.returncode == 0, done.stdout + done.stderr
    assert (f"skipping checkpoint {out / 'checkpoints' / step_dirname(2)}: {SHARDS[1]} has "
            f"{size // 2} bytes where the manifest records {size}") in done.stdout, done.stdout
    assert "(step 1)" in done.stdout
    index = json.loads((out / "checkpoints" / step_dirname(2) / "optimizer.json").read_text())
    assert index["files"] == ["optimizer-rank-00000-of-00001.safetensors"]
    done = run_ranks(GRPO, out, 2, *RUN, FSDP)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(step 2)" in done.stdout
    assert item_ids(out) == item_ids(runs["fsdp"])
    for step in (2, N):
        one, two = final_weights(out, step), final_weights(runs["fsdp"], step)
        assert _worst_rel(one, two) < 1e-10, step


_ONE_PROCESS = """
import torch
from runner.models import load_causal_lm, resolve_model_path
from runner.train.roles.sharding import blocks_of, full_named_weights, full_state_dict, shard_model
path = resolve_model_path("builtin:tiny-arith")
plain = load_causal_lm(path, dtype="float32", trust_remote_code=False)
model = load_causal_lm(path, dtype="float32", trust_remote_code=False)
blocks = blocks_of(model)
assert [type(b).__name__ for b in blocks] == ["Qwen2DecoderLayer"] * len(model.model.layers)
shard_model(model, bf16=True)
with torch.no_grad():
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
assert logits.dtype == torch.bfloat16, logits.dtype  # computed in bf16
named = dict(full_named_weights(model))  # after a forward without backward
assert named.keys() == dict(plain.named_parameters()).keys()
for name, p in plain.named_parameters():
    assert named[name].dtype == torch.float32 and torch.equal(named[name], p.detach()), name
state = full_state_dict(model, keep=True)
assert "lm_head.weight" not in state and torch.equal(state["model.norm.weight"],
                                                     plain.model.norm.weight.detach())
# An empty model (meta parameters) sharded and filled from the folder's files holds exactly
# what from_pretrained loads, buffers included.
from runner.train.roles.sharding import load_for_sharding
empty, folder = load_for_sharding(path, "float32", False)
assert folder == path and all(p.is_meta for p in empty.parameters())
shard_model(empty, bf16=False, weights=folder)
filled, want = full_state_dict(empty, keep=True), plain.state_dict()
assert filled and set(filled) <= set(want)
for n, t in filled.items():
    assert torch.equal(t, want[n]), n
buffers = dict(empty.named_buffers())
for n, b in plain.named_buffers():
    assert torch.equal(buffers[n], b), n
# LoRA on the sharded base: the merged weights the engine gets equal peft's merge of the same
# adapters on the whole model, and a checkpoint gathers the adapters alone.
from runner.recipe.schema import LoraConfig
from runner.train.roles.lora import apply_lora, is_adapter, merged_weights
whole = apply_lora(load_causal_lm(path, dtype="float32", trust_remote_code=False),
                   LoraConfig(rank=4, alpha=8.0), seed=0)
g = torch.Generator().manual_seed(1)
with torch.no_grad():
    for n, p in whole.named_parameters():
        if "lora_B" in n:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
lora = apply_lora(load_causal_lm(path, dtype="float32", trust_remote_code=False),
                  LoraConfig(rank=4, alpha=8.0), seed=0)
lora.load_state_dict(whole.state_dict())
shard_model(lora, bf16=False)
want, got = dict(merged_weights(whole)), dict(full_named_weights(lora))
assert got.keys() == want.keys() == dict(plain.named_parameters()).keys()
changed = [n for n in want if not torch.equal(want[n], dict(plain.named_parameters())[n])]
assert changed and all(".proj." in n or "_proj." in n for n in changed), changed
for n in want:
    assert torch.equal(got[n], want[n]), n  # the same products, in the same order
adapters = full_state_dict(lora, keep=True, only=is_adapter)
assert adapters and all("lora_" in n for n in adapters)
assert {n: t.shape for n, t in adapters.items()} == {
    n: t.shape for n, t in whole.state_dict().items() if is_adapter(n)}
print("ok")
"""


def test_one_process_fsdp_gathers_the_fp32_weights_after_a_forward():
    """World size 1 (an in-memory process group): the blocks are found by _no_split_modules,
    bf16 compute, and what leaves the model after a forward without backward (the root then
    holds unsharded bf16 parameters) is the fp32 weights, whole, tied LM head written once. An
    empty model filled shard by shard from the files equals a loaded one. A sharded LoRA model
    gives the engine peft's merge of its adapters, and checkpoints them alone."""
    done = subprocess.run([sys.executable, "-c", _ONE_PROCESS], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def _tiny_trained():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    return model, opt


def _staged_halves(root, model, opt):
    """What two sharded ranks stage for a checkpoint, made from a whole optimizer in one process:
    every moment cut in two on dim 0 (as FSDP2 shards), the step whole on both."""
    from runner.train.roles.sharding import optimizer_shard, stage_optimizer_shard

    index, whole = optimizer_shard(opt, model)
    halves: list[dict[str, torch.Tensor]] = [{}, {}]
    for key, slots in index["state"].items():
        for slot in slots:
            t = whole[f"{key}.{slot}"]
            if slot == "step":
                for h in halves:
                    h[f"{key}.{slot}"] = t.clone()
            else:
                slots[slot] = "shard0"
                for h, part in zip(halves, torch.chunk(t, 2), strict=False):
                    h[f"{key}.{slot}"] = part.clone()
                if len(torch.chunk(t, 2)) == 1:  # a single row: the second rank's share is empty
                    halves[1][f"{key}.{slot}"] = t[:0].clone()
    return index, [stage_optimizer_shard(root, 1, r, h) for r, h in enumerate(halves)]


def test_sharded_optimizer_files_round_trip_and_a_failed_write_removes_them(tmp_path,
                                                                              monkeypatch):
    """save_checkpoint moves the staged shards in under their names, the manifest lists them;
    load_checkpoint returns the index and a whole optimizer put together from the shards equals
    the one saved, bitwise. A write that fails removes the staged shards too."""
    from runner.state.checkpoint import ShardedState, save_checkpoint
    from runner.state.layout import TrainingState
    from runner.state.load import load_checkpoint
    from runner.train.roles.sharding import load_optimizer_shards

    model, opt = _tiny_trained()
    index, staged = _staged_halves(tmp_path, model, opt)
    state = TrainingState(step=1, cursor=None, scheduler={"last_epoch": 1}, world_size=2)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    path = save_checkpoint(tmp_path, 1, policy=ShardedState(model, weights, index, tuple(staged)),
                           tokenizer=None, state=state, metrics_rows=[])
    assert not any(p.exists() for p in staged)
    manifest = json.loads((path / "MANIFEST.json").read_text())["files"]
    assert set(SHARDS) <= manifest.keys() and "optimizer.safetensors" not in manifest
    loaded = load_checkpoint(path).optimizer_state
    assert loaded["sharded"]["files"] == list(SHARDS) and loaded["folder"] == path
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    load_optimizer_shards(fresh, path, loaded["sharded"], rank=0, world=1)
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i, slots in a["state"].items():
        for slot, value in slots.items():
            assert torch.equal(value, b["state"][i][slot]), (i, slot)

    index, staged = _staged_halves(tmp_path, model, opt)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(model), "save_pretrained", full_disk)
    with pytest.raises(RuntimeFailure, match="No space left"):
        save_checkpoint(tmp_path, 2, policy=ShardedState(model, {}, index, tuple(staged)),
                        tokenizer=None, state=state, metrics_rows=[])
    assert not any(p.exists() for p in staged)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]


# --- PPO: the critic sharded as the policy -------------------------------------------------------

PPO = "recipes/ppo-arith.toml"
N_PPO = 3
# One minibatch of two rows per rank in two micro-batches, two epochs: two optimizer steps of the
# policy and the critic per step, the first backward of each with gradient sync off. Every rank
# holds as many rows as micro-batches: DDP ranks running unequally many micro-batches were
# measured to depart from one rank's result (sharded ranks pad to equally many and agree with
# it: test_sharded_ranks_run_equally_many_micro_batches).
PPO_RUN = (f"run.max_steps={N_PPO}", "algo.prompts_per_step=2", "algo.samples_per_prompt=2",
           "algo.minibatches=1", "algo.ppo_epochs=2", "train.grad_accum_steps=2",
           "rollout.max_new_tokens=4", "data.validation.enabled=false",
           "checkpoint.every_steps=1", "checkpoint.keep_last=5", "logging.sample_every=0",
           "logging.item_ids=true", "model.dtype=float64", "train.padding_free=false",
           "algo.kl_coef=0")  # no reference (the GRPO runs shard one): one model less to load
CRITIC = "extra_models/critic/model.safetensors"
CRITIC_SHARDS = tuple(f"optimizer-critic-rank-{r:05d}-of-00002.safetensors" for r in (0, 1))


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory):
    """``{"none": folder, "fsdp": folder}``: the same 3 float64 PPO steps on 2 ranks each way."""
    return both_layouts(tmp_path_factory.mktemp("fsdp-ppo"), PPO, PPO_RUN)


@pytest.mark.slow
@pytest.mark.multiproc
def test_ppo_fsdp_and_ddp_agree_on_policy_and_critic_in_float64(ppo_runs):
    ddp, fsdp = ppo_runs["none"], ppo_runs["fsdp"]
    assert item_ids(ddp) == item_ids(fsdp) and len(item_ids(fsdp)) == N_PPO
    rows = {name: [r for r in deterministic_rows(out) if "loss" in r]
            for name, out in ppo_runs.items()}
    for a, b in zip(rows["none"], rows["fsdp"], strict=True):
        for key in ("grad_norm", "value_loss"):
            assert abs(a[key] - b[key]) <= 1e-10 * abs(a[key]), key
    for step in range(1, N_PPO + 1):
        for name in ("model/model.safetensors", CRITIC):
            one, two = final_weights(ddp, step, name), final_weights(fsdp, step, name)
            assert one.keys() == two.keys()
            assert all(two[k].dtype == one[k].dtype == torch.float64 for k in one)
            worst = _worst_rel(two, one)
            assert worst < 1e-10, (step, name, worst)
    start, end = final_weights(fsdp, 1, CRITIC), final_weights(fsdp, N_PPO, CRITIC)
    assert any(not torch.equal(start[k], end[k]) for k in start)  # the critic trained


@pytest.mark.slow
@pytest.mark.multiproc
def test_ppo_fsdp_checkpoint_layout(ppo_runs):
    """The critic's weights where an unsharded run writes them (the same names), its optimizer
    one safetensors file per rank under its own prefix, every file in the manifest."""
    folder = ppo_runs["fsdp"] / "checkpoints" / step_dirname(N_PPO)
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert set(SHARDS) | set(CRITIC_SHARDS) | {CRITIC, "optimizer-critic.json"} <= files
    assert not {"optimizer.safetensors", "optimizer-critic.safetensors"} & files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))], files
    manifest = json.loads((folder / "MANIFEST.json").read_text())["files"]
    assert files - {"COMPLETE", "MANIFEST.json"} == manifest.keys()
    index = json.loads((folder / "optimizer-critic.json").read_text())
    assert index["files"] == list(CRITIC_SHARDS)
    critic = final_weights(ppo_runs["fsdp"], N_PPO, CRITIC)
    assert critic.keys() == final_weights(ppo_runs["none"], N_PPO, CRITIC).keys()
    assert {p["name"] for p in index["params"].values()} == critic.keys()
    assert all(slots["exp_avg"] == "shard0" for slots in index["state"].values())


@pytest.mark.slow
@pytest.mark.multiproc
def test_ppo_fsdp_resumes_bitwise_unpickling_nothing(ppo_runs, tmp_path):
    """The sharded PPO run continued from its checkpoint 2 ends bitwise like the uninterrupted
    run (metrics, state, policy and critic weights, every rank's optimizer shards of both), no
    process of it unpickling a file."""
    out = tmp_path / "run"
    _rewind(ppo_runs["fsdp"], out, 2, N_PPO)
    env, log = _guard_env(tmp_path)
    done = subprocess.run([*CLI, PPO, f"run.output_dir={out}", "launch.backend=torchrun",
                           "launch.num_processes=2", *PPO_RUN, FSDP], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(step 2)" in done.stdout
    lines = log.read_text().splitlines()
    assert len([line for line in lines if line.startswith("guarded ")]) >= 3  # driver + 2 ranks
    assert [line for line in lines if not line.startswith("guarded ")] == [], log.read_text()
    assert_same_run(out, ppo_runs["fsdp"], N_PPO, (*FILES, CRITIC, *CRITIC_SHARDS))


@pytest.mark.slow
@pytest.mark.multiproc
def test_ppo_resume_on_one_sharded_rank(ppo_runs, tmp_path):
    """Steps 1-2 written by 2 sharded ranks, step 3 on one: the critic's optimizer state put
    together from its two shards as the policy's; in float64 both models end as the straight
    run's to 1e-10 (DDP's whole state cut into shards: test_resume_across_world_size...)."""
    written = "fsdp"
    out = tmp_path / "run"
    _rewind(ppo_runs[written], out, 2, N_PPO)
    done = run_ranks(PPO, out, 1, *PPO_RUN, FSDP)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(step 2)" in done.stdout
    assert item_ids(out) == item_ids(ppo_runs[written])
    for name in ("model/model.safetensors", CRITIC):
        one, two = final_weights(out, N_PPO, name), final_weights(ppo_runs[written], N_PPO, name)
        assert _worst_rel(one, two) < 1e-10, name


def test_ranks_together_run_equally_many_micro_batches(monkeypatch):
    """Every forward of several ranks is a collective (FSDP2 gathers parameters, DDP broadcasts
    buffers), and so is a sharded trainable's on one rank: a rank holding fewer rows of a
    minibatch than micro-batches runs zero-weighted ones on its first row until it has run as
    many as every rank; they are neither kept nor counted. One unsharded rank does not."""
    from runner.train.loops import batches
    from runner.train.loops.batches import Minibatch, train_minibatch_keeping

    def step(trainables, micro_losses, max_grad_norm):
        return float(sum(float(loss()) for loss in micro_losses))

    monkeypatch.setattr(batches, "optimizer_step", step)
    calls = []

    def loss_fn(idx):
        calls.append(idx.tolist())
        return torch.tensor(2.0), {"m": torch.tensor(3.0)}, len(calls)

    mb = Minibatch(rows=[1], weights=[1.0], total=2.0)
    padded = [[1], [0], [0]]
    for sharded, world, want in ((False, 1, [[1]]), (False, 2, padded), (True, 1, padded),
                                 (True, 2, padded)):
        calls.clear()
        trainable = attrs.evolve(_FakeTrainable(), sharded=sharded)
        metrics, kept = train_minibatch_keeping([trainable], mb, loss_fn, 3, world, 1.0)
        assert calls == want, (sharded, world)
        assert [(i.tolist(), v) for i, v in kept] == [([1], 1)]
        # the fake step returns the summed loss, 2 x share 1/2 x world; grad_norm is that / world
        assert metrics == {"m": 1.5, "grad_norm": 1.0}, (sharded, world)


@attrs.define
class _FakeTrainable:
    sharded: bool = False


# --- DPO: the reference sharded too ------------------------------------------------------------

DPO = "recipes/dpo-arith.toml"
# One held-out pair over two ranks: rank 1 holds none and runs filler forwards of the policy and
# the sharded reference while rank 0 scores its pair (without them either layout would hang).
DPO_RUN = ("run.max_steps=3", "algo.pairs_per_step=8", "train.grad_accum_steps=2",
           "data.validation.size=1", "train.eval_every=3", "checkpoint.every_steps=1",
           "checkpoint.keep_last=5", "logging.sample_every=0", "logging.item_ids=true",
           "model.dtype=float64", "train.padding_free=false")


@pytest.mark.slow
@pytest.mark.multiproc
def test_dpo_fsdp_and_ddp_agree_in_float64_with_an_uneven_held_out_set(tmp_path):
    made = both_layouts(tmp_path, DPO, DPO_RUN)
    ddp, fsdp = made["none"], made["fsdp"]
    assert item_ids(ddp) == item_ids(fsdp) and len(item_ids(fsdp)) == 3
    rows = {name: deterministic_rows(out) for name, out in made.items()}
    evals = [[r["eval/loss"] for r in rows[name] if "eval/loss" in r] for name in rows]
    assert len(evals[0]) == 2 and evals[0] == evals[1]  # steps 0 and 3: one pair, one rank
    for a, b in zip(rows["none"], rows["fsdp"], strict=True):
        if "loss" in a:
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * a["grad_norm"]
            assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"])
    for step in (1, 3):
        one, two = final_weights(ddp, step), final_weights(fsdp, step)
        worst = _worst_rel(two, one)
        assert worst < 1e-10, (step, worst)


# --- LoRA on a sharded base ----------------------------------------------------------------------

N_LORA = 2
LORA_RUN = (f"run.max_steps={N_LORA}", "model.lora.rank=4", "model.lora.alpha=8", "train.lr=3e-3",
            "algo.prompts_per_step=4", "algo.group_size=4", "algo.minibatches=2",
            "train.grad_accum_steps=2", "rollout.max_new_tokens=4",
            "data.validation.enabled=false", "checkpoint.every_steps=1", "checkpoint.keep_last=5",
            "logging.sample_every=0", "logging.item_ids=true", "model.dtype=float64",
            "train.padding_free=false")
ADAPTERS = "model/adapter_model.safetensors"


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """``{"none": folder, "fsdp": folder}``: the same 2 float64 LoRA GRPO steps on 2 ranks."""
    return both_layouts(tmp_path_factory.mktemp("fsdp-lora"), GRPO, LORA_RUN)


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_on_a_sharded_base_trains_and_saves_the_adapters_alone(lora_runs):
    """In float64 the sharded and the DDP run agree on every adapter to 1e-10 after each step;
    a checkpoint holds the adapters alone (peft's folder, no base weights) and an optimizer
    sharded per rank over them alone; the engine samples with the merged adapters (each step's
    first forward runs the weights the engine sampled with, or the logprob gap would be of an
    update's size)."""
    ddp, fsdp = lora_runs["none"], lora_runs["fsdp"]
    assert item_ids(ddp) == item_ids(fsdp) and len(item_ids(fsdp)) == N_LORA
    rows = {name: [r for r in deterministic_rows(out) if "loss" in r]
            for name, out in lora_runs.items()}
    for a, b in zip(rows["none"], rows["fsdp"], strict=True):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * a["grad_norm"]
        assert b["rollout/logprob_gap"] < 1e-4, b
    for step in range(1, N_LORA + 1):
        one, two = final_weights(ddp, step, ADAPTERS), final_weights(fsdp, step, ADAPTERS)
        assert one.keys() == two.keys() and all("lora_" in k for k in two)
        worst = _worst_rel(two, one)
        assert worst < 1e-10, (step, worst)
    assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_B" in k)  # trained
    folder = fsdp / "checkpoints" / step_dirname(N_LORA)
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {ADAPTERS, "model/adapter_config.json", *SHARDS} <= files
    assert "model/model.safetensors" not in files and "optimizer.safetensors" not in files
    index = json.loads((folder / "optimizer.json").read_text())
    names = [p["name"] for p in index["params"].values()]
    assert names and all(".lora_" in n for n in names)
    assert len(names) == len(two)  # every adapter trains, nothing else


# --- what fsdp does not run yet ----------------------------------------------------------------

def test_fp16_is_refused_and_lora_and_ray_are_taken():
    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / GRPO, [FSDP, "train.precision=fp16"])
    lines = [p for p in info.value.problems if p.key == "train.sharding"]
    assert len(lines) == 1 and "fp16" in lines[0].message, info.value.lines()
    recipe = load_recipe(REPO / GRPO, [FSDP, "model.lora.rank=4", "launch.backend=ray",
                                       "launch.num_processes=2", "launch.placement=separate"])
    assert recipe.train.sharding == "fsdp" and recipe.model.lora.rank == 4


def test_sharding_defaults_to_none_and_fsdp_loads():
    assert load_recipe(REPO / GRPO).train.sharding == "none"
    recipe = load_recipe(REPO / GRPO, [FSDP, "launch.backend=torchrun", "launch.num_processes=2"])
    assert recipe.train.sharding == "fsdp"
    from runner.recipe.plan import make_plan

    rows = dict(make_plan(recipe).rows())
    assert rows["launch"] == "torchrun, 2 process(es), policy sharded (FSDP2)"
    assert dict(make_plan(load_recipe(REPO / GRPO)).rows())["launch"] == "local, 1 process(es)"
    ppo = load_recipe(REPO / PPO, [FSDP, "launch.backend=torchrun", "launch.num_processes=2"])
    assert dict(make_plan(ppo).rows())["launch"] == ("torchrun, 2 process(es), policy, critic and "
                                                     "reference sharded (FSDP2)")


class _RankZeroOfTwo:
    """Rank 0's collective in a world whose rank 1 runs on a node that does not mount the run
    folder (``blind``) or does."""

    def __init__(self, blind: bool) -> None:
        self.blind = blind

    def gather(self, value):
        return [value, False if self.blind and isinstance(value, bool) else value]


@pytest.mark.parametrize("blind", [False, True])
def test_sharded_ranks_must_share_the_checkpoint_folder(tmp_path, blind):
    from runner.ranks.context import RankContext
    from runner.train.assembly.handshake import check_shared_folder

    folder = tmp_path / "checkpoints"
    if blind:
        with pytest.raises(RunnerError) as info:
            check_shared_folder(_RankZeroOfTwo(blind), RankContext(0, 2, 0), folder)
        assert str(info.value).startswith(f"rank(s) 1 cannot see the files rank 0 writes in "
                                          f"{folder}")
    else:
        check_shared_folder(_RankZeroOfTwo(blind), RankContext(0, 2, 0), folder)
    assert folder.is_dir() and list(folder.iterdir()) == []  # the probe file is removed
