"""Role pieces: dropout off in trained models, and an engine that refuses weights it cannot
place (a stale engine must never be silent)."""

from __future__ import annotations

import pytest
import torch

from runner.errors import RunnerError
from runner.train.roles.model_setup import disable_dropout


def test_disable_dropout_zeroes_every_dropout():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.3)
    model = Qwen2ForCausalLM(config)
    model.lm_head = torch.nn.Sequential(torch.nn.Dropout(0.5), model.lm_head)
    disable_dropout(model)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    attn = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert attn and all(m.attention_dropout == 0.0 for m in attn)
    model.train()
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(model(ids).logits, model(ids).logits)  # train mode, yet deterministic


def test_hf_engine_refuses_unknown_parameter_names():
    from runner.rollout.hf import HFEngine

    engine = HFEngine.from_path("builtin:tiny-arith")
    name, param = next(iter(engine.model.named_parameters()))
    before = param.detach().clone()
    engine.update_weights([(name, before + 1)])  # a known name is copied in place
    assert torch.equal(dict(engine.model.named_parameters())[name], before + 1)
    with pytest.raises(RunnerError, match="no parameter named model.nope"):
        engine.update_weights([("model.nope", torch.zeros(1))])


@pytest.mark.parametrize(("name", "overrides", "roles"), [
    ("grpo-arith", (), ["policy"]),
    ("dpo-arith", (), ["policy"]),
    ("opd-arith", (), ["policy", "teacher"]),
    ("ppo-arith", (), ["policy"]),  # the critic starts from the policy's folder
    ("ppo-arith", ("algo.critic_path=builtin:tiny-arith-teacher",), ["policy", "critic"]),
])
def test_ranks_compare_the_model_folders_of_the_planned_roles(name, overrides, roles):
    from runner.models import resolve_model_path
    from runner.recipe import load_recipe, make_plan
    from runner.train.assembly.assemble import _model_folders
    from tests.conftest import REPO

    recipe = load_recipe(REPO / "recipes" / f"{name}.toml", overrides)
    plan = make_plan(recipe, world_size=2)
    base = resolve_model_path(recipe.model.path)
    folders = _model_folders(recipe, plan.roles, base)
    assert list(folders) == roles and folders["policy"] == base
    for role in roles[1:]:
        assert folders[role] == resolve_model_path(getattr(recipe.algo, f"{role}_path"))


@pytest.mark.parametrize(("name", "overrides", "actors"), [
    ("grpo-arith", (), []),
    ("grpo-arith", ("algo.kl_beta=0.1",), ["reference"]),
    ("ppo-arith", (), ["reference"]),
    ("ppo-arith", ("algo.kl_coef=0",), []),
    ("dpo-arith", ("data.validation.enabled=false",), ["reference"]),
    ("opd-arith", (), ["teacher"]),
])
def test_ray_starts_a_frozen_actor_for_each_planned_frozen_role(name, overrides, actors):
    from runner.launch.ray_roles import frozen_roles
    from runner.recipe import load_recipe, make_plan
    from tests.conftest import REPO

    recipe = load_recipe(REPO / "recipes" / f"{name}.toml", overrides)
    assert frozen_roles(make_plan(recipe, world_size=1).roles) == actors
