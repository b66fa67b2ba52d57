"""``train.gradient_checkpointing``: the trained models keep each layer's input only and recompute
the layer in the backward pass; the numbers (gradients, runs) are the ones without it."""

from __future__ import annotations

import pytest
import torch

from runner.errors import RecipeError
from runner.recipe import load_recipe
from runner.train.roles.model_setup import checkpoint_activations, trained_model
from tests.conftest import REPO
from tests.resume_helpers import deterministic_rows
from tests.resume_helpers import run_cli as run_recipe


def _layer_calls(model) -> list[int]:
    """A counter of the decoder layers' forward calls (a pre-hook: the recomputation stops once
    it has what the backward needs, before a layer's end)."""
    calls = [0]
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_checkpointed_layers_run_again_in_the_backward_and_give_the_same_gradients():
    from runner.models import load_causal_lm

    plain, checkpointed = (load_causal_lm("builtin:tiny-arith").train() for _ in range(2))
    checkpoint_activations(checkpointed)
    layers = len(plain.model.layers)
    ids = torch.tensor([[1, 40, 22, 17, 23, 35, 7], [0, 0, 1, 41, 25, 18, 26]])
    mask = (torch.arange(7) >= torch.tensor([[0], [2]])).long()  # left-padded second row
    grads, calls = {}, {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        calls[name] = _layer_calls(model)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask, use_cache=False).logits,
                             -1)
        after_forward = calls[name][0]
        (-logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert after_forward == layers  # the forward runs each layer once
        calls[name] = calls[name][0]
    assert calls == {"plain": layers, "checkpointed": 2 * layers}  # recomputed in the backward
    assert grads["plain"].keys() == grads["checkpointed"].keys()
    assert all(torch.equal(grads["plain"][n], grads["checkpointed"][n]) for n in grads["plain"])

    checkpointed.eval()  # generation and scoring: no recomputation, no graph
    count = _layer_calls(checkpointed)
    with torch.no_grad():
        checkpointed(input_ids=ids, attention_mask=mask)
    assert count[0] == layers


def test_the_dry_run_says_what_becomes_of_the_activations(run_cli):
    for on, shown in (("true", "recomputed in the backward pass, one layer at a time "
                               "(train.gradient_checkpointing)"),
                      ("false", "kept for the backward pass (train.gradient_checkpointing = "
                                "false)")):
        rc, out, err = run_cli("--plain", "--dry-run", "recipes/grpo-arith.toml",
                               f"train.gradient_checkpointing={on}")
        assert rc == 0, err
        assert shown in " ".join(out.replace("│", " ").split())


def test_the_recipe_key_turns_it_on_and_a_model_without_support_is_refused_naming_it():
    from runner.models import load_causal_lm

    train = load_recipe(REPO / "recipes" / "grpo-arith.toml",
                        ["train.gradient_checkpointing=true"]).train
    assert trained_model(load_causal_lm("builtin:tiny-arith"), train).is_gradient_checkpointing
    off = load_recipe(REPO / "recipes" / "grpo-arith.toml", []).train
    assert not off.gradient_checkpointing
    assert not trained_model(load_causal_lm("builtin:tiny-arith"), off).is_gradient_checkpointing
    with pytest.raises(RecipeError) as err:
        trained_model(torch.nn.Linear(2, 2), train)
    assert "train.gradient_checkpointing" in str(err.value) and "Linear" in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "precision"), [
    ("grpo-arith", "no"), ("ppo-arith", "no"),
    # bf16 autocast: the recomputed layers cast again (autocast keeps no cache) and take the
    # forward's attention kernel (on CPU the math one) in the backward
    ("grpo-arith", "bf16")])
def test_a_run_with_checkpointing_equals_one_without(tmp_path, recipe, precision):
    """Every metric (a held-out evaluation included) and every tensor of the checkpoint (the
    policy, PPO's critic, the optimizers) bitwise."""
    from safetensors.torch import load_file

    common = (f"train.precision={precision}", "run.max_steps=2", "logging.sample_every=0",
              "data.validation.size=8", "train.eval_every=2", "checkpoint.every_steps=2")
    for on in ("true", "false"):
        done = run_recipe(f"recipes/{recipe}.toml", tmp_path / on, *common,
                          f"train.gradient_checkpointing={on}")
        assert done.returncode == 0, done.stdout + done.stderr
    got, want = deterministic_rows(tmp_path / "true"), deterministic_rows(tmp_path / "false")
    assert len(got) == 3 and got == want  # step 0's evaluation and two steps
    files = sorted(p.relative_to(tmp_path / "false")
                   for p in (tmp_path / "false").glob("checkpoints/step-*/**/*.safetensors")
                   if p.name != "rng.safetensors")
    assert any("critic" in str(f) for f in files) == (recipe == "ppo-arith")
    for name in files:
        one, two = load_file(tmp_path / "true" / name), load_file(tmp_path / "false" / name)
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one), name
