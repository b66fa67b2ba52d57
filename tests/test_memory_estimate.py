"""The per-rank memory of the models' state that --dry-run shows, from the folders' safetensors
headers: parameter counts checked against the loaded models (and LoRA's against peft's), the
byte arithmetic by hand, and the refusal of a layout larger than the device."""

from __future__ import annotations

import attrs
import pytest

from runner.models import resolve_model_path
from runner.models.memory import StateBytes, count, lora_count, tensor_shapes
from runner.preflight import estimate_state
from runner.recipe import load_recipe
from tests.conftest import REPO


def _loaded(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(path))


@pytest.mark.parametrize("path", ["builtin:tiny-arith", "builtin:tiny-arith-teacher"])
def test_header_count_equals_the_loaded_model(path):
    model = _loaded(path)
    shapes = tensor_shapes(resolve_model_path(path))
    assert count(shapes) == sum(p.numel() for p in model.parameters())


def test_lora_count_equals_peft_trainable_parameters():
    from runner.recipe.schema import LoraConfig
    from runner.train.roles.lora import apply_lora, trainable_share

    shapes = tensor_shapes(resolve_model_path("builtin:tiny-arith"))
    for targets in ([], ["q_proj", "v_proj"]):
        cfg = LoraConfig(rank=4, alpha=8.0, target_modules=targets)
        trained, _ = trainable_share(apply_lora(_loaded("builtin:tiny-arith"), cfg, 0))
        assert lora_count(shapes, 4, targets) == trained, targets


def test_ppo_on_two_ranks_by_hand():
    recipe = load_recipe(REPO / "recipes/ppo-arith.toml", ["launch.backend=torchrun",
                                                           "launch.num_processes=2",
                                                           "algo.kl_coef=0.05"])
    n = count(tensor_shapes(resolve_model_path(recipe.model.path)))
    est = estimate_state(recipe, 2)
    # float32: the policy and the critic 4n parameters + 4n gradients + 8n AdamW moments each,
    # the reference 4n (fp32 or 2n under bf16 autocast)
    ref = est.full["reference"].params
    assert ref in (4 * n, 2 * n)
    assert est.full["policy"] == est.full["critic"] == StateBytes(4 * n, 4 * n, 8 * n)
    assert est.per_rank(False) == 32 * n + ref
    # FSDP shards the policy, PPO's critic and the reference
    assert n % 2 == 0 and ref % 2 == 0 and est.per_rank(True) == 8 * n + 8 * n + ref // 2
    assert est.layout == "DDP" and est.problems() == []  # the CPU reports no device memory
    rows = dict(est.rows())
    assert "<- this run" in rows["model state per rank, DDP"]
    assert "device memory" in rows


def test_lora_trains_fewer_bytes_and_a_too_small_device_is_refused():
    recipe = load_recipe(REPO / "recipes/grpo-arith.toml", ["model.lora.rank=4"])
    est = estimate_state(recipe, 1)
    n = count(tensor_shapes(resolve_model_path(recipe.model.path)))
    k = lora_count(tensor_shapes(resolve_model_path(recipe.model.path)), 4, [])
    assert est.full["policy"] == StateBytes(4 * n, 4 * k, 8 * k)
    assert "reference" not in est.full  # GRPO with kl_beta = 0 builds none
    small = attrs.evolve(est, device_bytes=est.per_rank(False) - 1, device="cuda:0, test")
    (problem,) = small.problems()
    assert problem.key == "launch.num_processes"
    assert "more than the" in problem.message and "cuda:0, test" in problem.message
    assert attrs.evolve(est, device_bytes=est.per_rank(False)).problems() == []


def test_dry_run_shows_the_memory_section(run_cli):
    rc, out, err = run_cli("--plain", "--dry-run", "recipes/grpo-arith.toml")
    assert rc == 0, err
    assert "Memory (estimated from the model folders)" in out
    assert "model state per rank, FSDP over 1" in out


def test_a_sharded_run_is_estimated_sharded():
    recipe = load_recipe(REPO / "recipes/grpo-arith.toml", [
        "launch.backend=torchrun", "launch.num_processes=2", "train.sharding=fsdp",
        "algo.kl_beta=0.1"])
    est = estimate_state(recipe, 2)
    n = count(tensor_shapes(resolve_model_path(recipe.model.path)))
    assert est.layout == "FSDP"
    # the policy and GRPO's reference sharded over 2
    assert est.per_rank(True) == 8 * n + est.full["reference"].params // 2
    assert "<- this run" in dict(est.rows())["model state per rank, FSDP over 2"]


def test_role_actors_hold_the_frozen_models_under_the_separate_placement(tmp_path):
    """On Ray with ``placement = "separate"`` the reference and each reward model live in role
    actors of their own: the ranks' estimate leaves them out and a row lists them; colocated
    ranks hold them."""
    import shutil

    import torch

    from runner.models import load_causal_lm
    from runner.preview import packing_rows

    rm = tmp_path / "rm"
    torch.manual_seed(0)
    load_causal_lm("builtin:tiny-arith", head="score").save_pretrained(rm)
    for f in resolve_model_path("builtin:tiny-arith").iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, rm / f.name)
    common = ["launch.backend=ray", "launch.num_processes=2", "algo.kl_beta=0.1",
              f'reward.functions=["model:{rm}"]']
    n = count(tensor_shapes(resolve_model_path("builtin:tiny-arith")))
    scored = count(tensor_shapes(rm))
    separate = estimate_state(load_recipe(REPO / "recipes/grpo-arith.toml",
                                          [*common, "launch.placement=separate"]), 2)
    colocated = estimate_state(load_recipe(REPO / "recipes/grpo-arith.toml", common), 2)
    assert set(separate.full) == {"policy"}
    assert set(separate.actors) == {"reference", "reward model"}
    assert separate.actors["reward model"].params == 4 * scored and scored != n
    assert dict(separate.rows())["in role actors of their own"].startswith("reference ")
    assert set(colocated.full) == {"policy", "reference", "reward model"} and not colocated.actors
    assert colocated.per_rank(False) - separate.per_rank(False) == sum(
        s.total for s in separate.actors.values())
    where = {placement: dict(packing_rows(load_recipe(
        REPO / "recipes/grpo-arith.toml", [*common, f"launch.placement={placement}"])))[
            "reward model (reward.functions[0])"] for placement in ("separate", "colocated")}
    assert "in a Ray actor of its own" in where["separate"]
    assert "in the rank's process" in where["colocated"]
