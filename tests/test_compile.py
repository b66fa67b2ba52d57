"""``train.compile``: the trained and frozen models' forwards run through torch.compile, a text
model's generation too (a vision-language model's generation stays eager).

The default suite traces with torch.compile's "eager" backend (the captured graph run op by op,
so the numbers are eager's bitwise) and checks the recipe's rules; a whole compiled run with
torch's code generator (inductor), which spends over a minute compiling on a cold cache, is an
``extended`` test: it resumes bitwise and stays within float error of an eager run.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from runner.models.compiled import compile_forwards
from runner.recipe import load_recipe
from runner.train.roles.model_setup import trained_model
from tests.conftest import REPO
from tests.resume_helpers import (
    assert_same_run,
    deterministic_rows,
    start_cli,
    wait_for_checkpoint,
)
from tests.resume_helpers import (
    run_cli as run_recipe,
)


def _frames() -> int:
    """Frames torch.compile has captured in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches and counters empty before the test and after it (the worker
    runs other test files next)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_forwards_equal_eager_ones_and_generation_is_compiled_too(fresh_dynamo):
    from runner.models import load_causal_lm

    plain = load_causal_lm("builtin:tiny-arith").train()
    traced = load_causal_lm("builtin:tiny-arith").train()
    compile_forwards(traced, backend="eager")
    ids = torch.tensor([[1, 40, 22, 17, 23, 35, 7], [0, 0, 1, 41, 25, 18, 26]])
    mask = (torch.arange(7) >= torch.tensor([[0], [2]])).long()  # left-padded second row
    before = _frames()
    grads = {}
    for name, model in (("plain", plain), ("traced", traced)):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])
        (-logp.mean()).backward()
        grads[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert _frames() > before  # the traced model's forward went through torch.compile
    assert torch.equal(grads["plain"][0], grads["traced"][0])
    assert all(torch.equal(g, grads["traced"][1][n]) for n, g in grads["plain"][1].items())

    # another length is the same graph (dynamic shapes)
    captured = _frames()
    traced(input_ids=ids[:, 1:].contiguous(), attention_mask=mask[:, 1:].contiguous(),
           use_cache=False)
    assert _frames() == captured, "a shorter batch compiled a new graph"
    # a scoring forward in eval mode is compiled (a graph of its own); so is generation (its
    # prefill and decoding steps), sampling the tokens eager generation samples
    traced.eval()
    with torch.no_grad():
        scored = traced(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert torch.equal(scored, plain.eval()(input_ids=ids, attention_mask=mask,
                                                use_cache=False).logits)
        assert _frames() == captured + 1
        out = traced.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                              do_sample=False, pad_token_id=0)
        want = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                              do_sample=False, pad_token_id=0)
        assert _frames() > captured + 1, "generation did not go through torch.compile"
        generated = _frames()
        # a wider batch, padded otherwise, generating longer: the same graphs
        ids2 = torch.tensor([[1, 40, 22, 17, 23, 35, 7, 30, 31], [0, 0, 0, 1, 41, 25, 18, 26, 27]])
        mask2 = (torch.arange(9) >= torch.tensor([[0], [3]])).long()
        again = traced.generate(input_ids=ids2, attention_mask=mask2, max_new_tokens=5,
                                do_sample=False, pad_token_id=0)
        assert torch.equal(again, plain.generate(input_ids=ids2, attention_mask=mask2,
                                                 max_new_tokens=5, do_sample=False,
                                                 pad_token_id=0))
    assert torch.equal(out, want)
    assert _frames() == generated, "another width and length compiled new graphs"


def test_a_vision_language_models_generation_stays_eager(fresh_dynamo):
    """A model with a vision config: its forwards without a cache are compiled, the ones that
    keep a cache (generation: image inputs and position state carried between calls) are not."""
    calls = []

    class Config:
        vision_config = object()

    class Model(torch.nn.Module):
        config = Config()

        def forward(self, x, use_cache=True):
            calls.append(torch.compiler.is_compiling())
            return x + 1

    model = compile_forwards(Model(), backend="eager")
    x = torch.ones(2)
    assert torch.equal(model(x, use_cache=False), x + 1)
    assert torch.equal(model(x, use_cache=True), x + 1)
    assert torch.equal(model(x), x + 1)
    assert calls == [True, False, False]
    plain = compile_forwards(type("Text", (Model,), {"config": None})(), backend="eager")
    calls.clear()
    plain(x), plain(x, use_cache=False)
    assert calls == [True, True]


def test_an_hf_engine_on_its_own_copy_is_compiled_with_the_key():
    from runner.models import resolve_model_path
    from runner.rollout.factory import make_engine

    path = resolve_model_path("builtin:tiny-arith")
    for flag, wrapped in (("true", True), ("false", False)):
        recipe = load_recipe(REPO / "recipes" / "grpo-arith.toml", [f"train.compile={flag}"])
        engine = make_engine(recipe, path, dtype="float32", max_model_len=None)
        assert ("forward" in vars(engine.model)) == wrapped


def test_the_recipe_key_compiles_the_trained_models_and_sharded_ones_are_refused(run_cli):
    from runner.models import load_causal_lm

    on = load_recipe(REPO / "recipes" / "dpo-arith.toml", ["train.compile=true"]).train
    off = load_recipe(REPO / "recipes" / "dpo-arith.toml", []).train
    assert not off.compile
    model = load_causal_lm("builtin:tiny-arith")
    eager = model.forward
    assert trained_model(model, on).forward is not eager  # wrapped
    # with the model's own signature: transformers reads which arguments forward takes
    assert inspect.signature(model.forward) == inspect.signature(eager)
    other = load_causal_lm("builtin:tiny-arith")
    assert trained_model(other, off).forward == other.forward  # the class's own method
    assert "forward" not in vars(other)

    rc, out, err = run_cli("--plain", "recipes/dpo-arith.toml", "train.compile=true",
                           "train.sharding=fsdp")
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "command line: train.compile: sharded models (train.sharding = 'fsdp') run eager: "
        "compiling them is not supported (got True). Set train.compile = false (or "
        "train.sharding = 'none').")

    for flag, shown in (("true", "compiled (train.compile): training and scoring forwards and "
                                 "the hf engine's generation (text models) through torch.compile, "
                                 "at their first call"),
                        ("false", "eager (train.compile = false)")):
        rc, out, err = run_cli("--plain", "--dry-run", "recipes/dpo-arith.toml",
                               f"train.compile={flag}")
        assert rc == 0, err
        assert shown in " ".join(out.replace("│", " ").split())


def test_a_cpu_without_a_cpp_compiler_is_told_before_the_run(run_cli, tmp_path):
    """torch.compile builds C++ kernels on a CPU: no compiler is one line before any model is
    loaded, naming the key (the search is torch's own, given a compiler that does not exist;
    inductor's own patch restores its setting after, which monkeypatch would delete)."""
    from torch._inductor import config

    with config.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        rc, out, err = run_cli("--plain", "recipes/dpo-arith.toml", "train.compile=true",
                               f"run.output_dir={tmp_path / 'out'}")
    assert config.cpp.cxx != ("no-such-c++-compiler",)
    assert rc == 2, out + err
    assert err.strip().splitlines()[-1] == (
        "recipes/dpo-arith.toml: train.compile: torch.compile needs a C++ compiler to build CPU "
        "kernels and none was found (tried $CXX, then g++) (got True). Install g++ (or point "
        "CXX at a C++ compiler), or set train.compile = false.")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    rc, out, err = run_cli("--plain", "--validate", "recipes/dpo-arith.toml")  # not asked: fine
    assert rc == 0, err


def _straight_then_killed_and_resumed(recipe: str, tmp_path, *overrides: str):
    """``recipe`` run straight (``overrides``: 4 steps, a checkpoint every 2), and again killed
    after its 2nd checkpoint then resumed: the resumed run equals the straight one bitwise (every
    metric, the weights and the optimizer state of checkpoint 4). Returns the straight run's
    folder."""
    straight = tmp_path / "straight"
    done = run_recipe(recipe, straight, *overrides)
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = tmp_path / "resumed"
    proc = start_cli(recipe, resumed, *overrides)
    wait_for_checkpoint(proc, resumed, 2)
    proc.kill()
    proc.communicate()
    done = run_recipe(recipe, resumed, *overrides)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming" in done.stdout
    assert_same_run(resumed, straight, 4, ("model/model.safetensors", "optimizer.safetensors"))
    return straight


@pytest.mark.extended  # over a minute of compilation on a cold cache
def test_a_compiled_run_resumes_bitwise_and_stays_within_float_error_of_eager(tmp_path):
    """DPO compiled by inductor: killed after its second checkpoint and resumed, every metric
    and the checkpoint's weights and optimizer state equal the straight compiled run's bitwise;
    its losses equal an eager run's within float32 error (1e-5 relative; measured 1.1e-6)."""
    common = ("run.max_steps=4", "checkpoint.every_steps=2", "data.validation.enabled=false",
              "logging.sample_every=0")
    straight = _straight_then_killed_and_resumed("recipes/dpo-arith.toml", tmp_path,
                                                 *common, "train.compile=true")

    eager = tmp_path / "eager"
    done = run_recipe("recipes/dpo-arith.toml", eager, *common)
    assert done.returncode == 0, done.stdout + done.stderr
    got = [r["loss"] for r in deterministic_rows(straight) if "loss" in r]
    want = [r["loss"] for r in deterministic_rows(eager) if "loss" in r]
    assert len(got) == len(want) == 4
    assert got != want  # compiled kernels: other roundings
    assert got == pytest.approx(want, rel=1e-5, abs=0)


@pytest.mark.extended  # a minute of compilation
def test_a_compiled_grpo_run_with_compiled_generation_resumes_bitwise(tmp_path):
    """GRPO compiled, its generation too (the hf engine on the policy's own module): killed after
    its second checkpoint and resumed in a new process (which compiles the graphs again), every
    metric (the rewards and completion lengths of what was sampled included), the weights and
    the optimizer state equal the straight run's bitwise."""
    _straight_then_killed_and_resumed("recipes/grpo-arith.toml", tmp_path, "run.max_steps=4",
                                      "checkpoint.every_steps=2", "data.validation.enabled=false",
                                      "train.compile=true")
