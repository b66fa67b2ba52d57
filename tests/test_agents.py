"""Agents written against the OpenAI API (``[env] agent``): the runner serves the policy to the
user's agent on 127.0.0.1 and trains the tokens the engine sampled, in lockstep.

The end-to-end check: the openai-SDK agent of ``examples/openai_agent.py``, which does what the
built-in tool environment does, trains exactly the run of ``recipes/grpo-tools.toml`` (the same
losses and weights, bitwise): the prompts it sends render to the same tokens, its tool results
append the same tokens, every turn is seeded the same. Sampling one step ahead, the run SIGKILLed
while its agents play resumes bitwise, and two torchrun ranks, each serving its own agents,
play the one-rank run's episodes."""

from __future__ import annotations

import math
import os
import time

import attrs
import pytest
import torch

from runner.envs.agents import AgentRunner
from runner.errors import RuntimeFailure
from runner.models.builtin import builtin_folder
from runner.packers.decoder_only import DecoderOnlyLLMDataPacker
from runner.recipe import load_recipe
from runner.rollout.base import SamplingConfig
from runner.types import ObsBundle
from tests.conftest import REPO
from tests.extmods import agents as A
from tests.multiproc import descendants, listeners_of, self_served, start_ranks, wait_gone
from tests.resume_helpers import (
    assert_same_run,
    deterministic_rows,
    final_weights,
    run_cli,
    start_cli,
    wait_for_checkpoint,
)
from tests.test_torchrun import FLOAT32_LAYOUT_REL

pytestmark = pytest.mark.slow
ITEM = ObsBundle("What is 21 + 77?", reference="98", id="q")


@pytest.fixture(scope="module")
def engine():
    from runner.rollout.factory import make_engine

    recipe = load_recipe(REPO / "recipes/grpo-tools.toml")
    packer = DecoderOnlyLLMDataPacker()
    packer.setup(str(builtin_folder("tiny-arith-tools")))
    eng = make_engine(recipe, builtin_folder("tiny-arith-tools"), dtype="float32",
                      max_model_len=None)
    yield packer, eng
    eng.close()


def play(engine, agent, *overrides, n=2, items=(ITEM,), generate=None):
    packer, eng = engine
    recipe = load_recipe(REPO / "recipes/grpo-openai-agent.toml",
                         [f"env.agent={agent}", "env.agent_kwargs={}", *overrides])
    runner = AgentRunner(recipe.env, packer, getattr(A, agent.rsplit(".", 1)[1]), "tiny",
                         continuous=recipe.rollout.server_batching == "continuous")
    try:
        results = runner.play(generate or eng.generate, lambda *a: None, list(items),
                              SamplingConfig(n=n, max_new_tokens=16, temperature=1.0),
                              [5] * len(items))
        return results, runner
    finally:
        if runner.server is not None:
            runner.server.stop()


def test_the_agents_tokens_are_the_engines_and_its_rewards_arrive(engine):
    results, runner = play(engine, "tests.extmods.agents.follows_up")
    packer, _ = engine
    for r in results:
        assert r.env_reward == 0.5 and r.stats["turns"] == 2.0
        trained = [t for t, m in zip(r.completion.token_ids, r.loss_mask, strict=True) if m]
        first = r.completion.token_ids.index(packer.eos_token_id) + 1
        # the first reply (the engine's, to its eos), then the template's follow-up (not
        # trained), then the second reply
        assert r.loss_mask[:first] == (1,) * first and 0 in r.loss_mask[first:]
        assert len(trained) == sum(r.loss_mask) and r.completion.logprobs[first] == 0.0
    results, _ = play(engine, "tests.extmods.agents.one_call", "env.agent_kwargs={reward = "
                      "{ a = 1.0, b = 0.25 }}", n=1)
    assert results[0].env_reward == 1.25 and results[0].stats["agent_a"] == 1.0


def test_the_episodes_do_not_depend_on_how_many_play_at_once(engine):
    items = [ObsBundle(f"What is {a} + {b}?", str(a + b)) for a, b in ((12, 30), (45, 11))]
    wide, _ = play(engine, "tests.extmods.agents.follows_up", "env.concurrency=8", items=items)
    narrow, _ = play(engine, "tests.extmods.agents.follows_up", "env.concurrency=1",
                     items=items)
    assert [r.completion.token_ids for r in wide] == [r.completion.token_ids for r in narrow]


@pytest.mark.parametrize(("agent", "words"), [
    ("rewrites", "does not send back the conversation so far"),
    ("raises", "raised RuntimeError: the agent gave up"),
    ("wrong_key", "raised AuthenticationError"),
])
def test_an_agent_that_breaks_the_contract_is_named(engine, agent, words):
    with pytest.raises(RuntimeFailure) as caught:
        play(engine, f"tests.extmods.agents.{agent}", n=1)
    line = str(caught.value)
    assert f"tests.extmods.agents.{agent}" in line and words in line and "item 'q'" in line
    results, _ = play(engine, f"tests.extmods.agents.{agent}", "env.on_agent_error=zero", n=1)
    assert results[0].env_reward == 0.0 and results[0].stats["agent_error"] == 1.0


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_continuous_batching_serves_a_waiting_call_without_the_busy_agent(engine, batching):
    """Two episodes of three calls each, one agent pausing 0.5 s after each reply. Lockstep: the
    engine serves both episodes' calls together, three engine calls of two. Continuous: the
    quick episode's calls are served as they come, the paused one's second and third alone."""
    _, eng = engine
    sizes = []

    def generate(prompts, *args):
        sizes.append(len(prompts))
        return eng.generate(prompts, *args)

    items = [ObsBundle("What is 12 + 30?", "42", id="slow"),
             ObsBundle("What is 45 + 11?", "56", id="fast")]
    results, _ = play(engine, "tests.extmods.agents.paced", f"rollout.server_batching={batching}",
                      "env.agent_kwargs={pause = 0.5}", n=1, items=items, generate=generate)
    turns = [r.stats["turns"] for r in results]
    assert sum(sizes) == sum(turns) and min(turns) >= 2, (sizes, turns)
    if batching == "lockstep":
        assert sizes == [2] * int(min(turns)) + [1] * int(max(turns) - min(turns)), sizes
    else:
        assert len(sizes) >= sum(turns) - 1 and sizes.count(1) >= sum(turns) - 2, sizes


def test_a_hanging_agent_is_cut_and_an_idle_one_trains_nothing(engine):
    results, _ = play(engine, "tests.extmods.agents.hangs", "env.on_agent_error=zero",
                      "env.episode_timeout_s=1", n=1)
    assert results[0].stats["agent_timeout"] == 1.0 and results[0].env_reward == 0.0
    assert sum(results[0].loss_mask) > 0  # what it sampled before is kept, with reward 0
    results, _ = play(engine, "tests.extmods.agents.never_asks", n=1)
    assert results[0].env_reward == 2.0 and sum(results[0].loss_mask) == 0


def test_the_endpoint_listens_on_loopback_only(engine):
    """The endpoint is one new listener, on 127.0.0.1, gone after stop (listeners this process
    had before, of other tests in the same worker, are not the endpoint's)."""
    packer, eng = engine
    recipe = load_recipe(REPO / "recipes/grpo-openai-agent.toml")
    runner = AgentRunner(recipe.env, packer, A.one_call, "tiny")
    before = set(listeners_of({os.getpid()}))
    try:
        url = runner._endpoint().url
        assert url.startswith("http://127.0.0.1:")
        port = url.split(":")[2].split("/")[0]
        listening = listeners_of({os.getpid()})
        assert set(listening) - before == {f"127.0.0.1:{port}"}, (listening, before)
        assert all(a.startswith("127.0.0.1:") for a in listening), listening
    finally:
        runner.server.stop()
    assert set(listeners_of({os.getpid()})) <= before


def test_a_proxy_in_the_environment_does_not_get_the_agents_calls(engine, monkeypatch):
    """The agents' client calls the runner's own endpoint on 127.0.0.1 directly, whatever
    proxy the environment names (before, every call went to it and failed)."""
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    results, _ = play(engine, "tests.extmods.agents.one_call", "env.agent_kwargs={reward = 1.0}",
                      n=1)
    assert results[0].env_reward == 1.0 and results[0].stats["turns"] == 1.0


def test_an_openai_sdk_agent_trains_exactly_as_the_built_in_tool_environment(tmp_path):
    common = ("run.max_steps=2", "algo.prompts_per_step=4", "algo.group_size=4",
              "data.validation.size=8", "train.eval_every=2", "logging.sample_every=0")
    for name in ("grpo-tools", "grpo-openai-agent"):
        done = run_cli(f"recipes/{name}.toml", tmp_path / name, *common)
        assert done.returncode == 0, done.stdout + done.stderr
    tools, agent = (deterministic_rows(tmp_path / n) for n in ("grpo-tools", "grpo-openai-agent"))
    keys = ("loss", "reward/mean", "env/turns", "env/tool_calls")
    assert [[r.get(k) for k in keys] for r in tools] == [[r.get(k) for k in keys] for r in agent]
    a, b = (final_weights(tmp_path / n, 2) for n in ("grpo-tools", "grpo-openai-agent"))
    assert all((a[k] == b[k]).all() for k in a)


def _with_algo(recipe: str, algo: str, out) -> str:
    """``recipe``'s text with its ``[algo]`` table replaced by ``algo``, written to ``out``."""
    text = (REPO / recipe).read_text()
    start, end = text.index("[algo]"), text.index("[rollout]")
    out.write_text(text[:start] + "[algo]\n" + algo + "\n" + text[end:])
    return str(out)


def test_ppo_and_opd_train_an_openai_sdk_agent_exactly_as_the_built_in_tool_environment(
        tmp_path):
    """The agent of ``examples/openai_agent.py`` under PPO (policy, critic and reference) and
    OPD (its teacher: the PPO run's checkpoint, so the KL is not zero) trains bitwise as the
    built-in tool environment does: the same losses, gradient norms, turns and weights."""
    common = ("run.max_steps=1", "data.validation.enabled=false", "logging.sample_every=0")
    ppo = ('kind = "ppo"\nprompts_per_step = 4\nsamples_per_prompt = 2\nminibatches = 2\n'
           "kl_coef = 0.02\n")
    opd = ('kind = "opd"\nmode = "same_tokenizer"\nprompts_per_step = 4\n'
           f'samples_per_prompt = 2\nteacher_path = "{tmp_path / "ppo-grpo-tools"}"\n')
    keys = ("loss", "grad_norm", "reward/mean", "env/turns", "env/tool_calls")
    for kind, algo in (("ppo", ppo), ("opd", opd)):
        runs = []
        for name in ("grpo-tools", "grpo-openai-agent"):
            out = tmp_path / f"{kind}-{name}"
            recipe = _with_algo(f"recipes/{name}.toml", algo, tmp_path / f"{kind}-{name}.toml")
            done = run_cli(recipe, out, *common)
            assert done.returncode == 0, done.stdout + done.stderr
            runs.append(out)
        tools, agent = ([[r.get(k) for k in keys] for r in deterministic_rows(out)
                         if "loss" in r] for out in runs)
        assert tools == agent and len(tools) == 1, (kind, tools, agent)
        assert tools[0][0] != 0.0 and tools[0][3] >= 1.0, (kind, tools)  # a loss, played turns
        a, b = (final_weights(out, 1) for out in runs)
        assert all((a[k] == b[k]).all() for k in a), kind


# --- sampling ahead, SIGKILL and resume, torchrun ranks ---------------------------------------

AGENT = "recipes/grpo-openai-agent.toml"
STEPS = 4
# one step ahead: the producer thread plays the next step's episodes (and rewards them) while
# the current step trains
AHEAD = ("algo.prompts_per_step=4", "algo.group_size=4", "data.validation.size=8",
         "train.eval_every=2", "logging.sample_every=0", "logging.item_ids=true",
         "checkpoint.every_steps=1", "checkpoint.keep_last=10", "algo.max_off_policy_steps=1")
FILES = ("model/model.safetensors", "optimizer.safetensors")


@pytest.fixture(scope="module")
def ahead(tmp_path_factory):
    """The recipe's agent sampling one step ahead, uninterrupted, on one rank."""
    out = tmp_path_factory.mktemp("ahead")
    done = run_cli(AGENT, out, f"run.max_steps={STEPS}", *AHEAD)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _trained(out) -> list[dict]:
    return [r for r in deterministic_rows(out) if "loss" in r]


def _agents_playing(pid: int) -> bool:
    """Whether the run's episodes are being played: each of a batch's 16 episodes (8 held-out
    ones) runs its agent on a thread of its own; between batches the run has a few threads."""
    try:
        return len(os.listdir(f"/proc/{pid}/task")) >= 12
    except OSError:
        return False


def test_killed_while_its_agents_play_then_resumed_equals_the_uninterrupted_run(ahead, tmp_path):
    """With the producer playing the next step's episodes, the run is SIGKILLed after checkpoint
    1 while agents are calling its endpoint: nothing of it is left (no process, no listener),
    and the rerun, resuming with the batch the checkpoint held, ends bitwise like the
    uninterrupted run."""
    rows = _trained(ahead)
    assert [r["rollout/staleness_max"] for r in rows] == [0.0] + [1.0] * (STEPS - 1)
    assert all(r["env/turns"] >= 1.0 for r in rows)
    proc = start_cli(AGENT, tmp_path, f"run.max_steps={STEPS}", *AHEAD)
    wait_for_checkpoint(proc, tmp_path, 1)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not _agents_playing(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.002)
    family = descendants(proc.pid)
    addresses = listeners_of(family)
    assert proc.poll() is None, "the run ended before its agents played after checkpoint 1"
    assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
    proc.kill()
    proc.communicate()
    assert wait_gone(sorted(family), timeout_s=10) == []
    assert listeners_of(family) == []
    done = run_cli(AGENT, tmp_path, f"run.max_steps={STEPS}", *AHEAD)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming" in done.stdout
    assert_same_run(tmp_path, ahead, STEPS, FILES)


@pytest.mark.multiproc
def test_two_torchrun_ranks_each_serve_their_agents_and_play_the_one_rank_episodes(ahead,
                                                                                  tmp_path):
    """Two ranks, sampling ahead: each rank serves its own agents on a loopback port of its own,
    and the episodes (items, turns, tool calls, rewards) of both steps equal the one-rank
    run's. Both steps' batches were sampled by the initial weights (the second one ahead), so
    they cannot differ by the float32 rounding of the world size; the losses and gradient norms
    agree within it (``FLOAT32_LAYOUT_REL``, as for GRPO in test_torchrun.py)."""
    proc = start_ranks(AGENT, tmp_path, 2, "run.max_steps=2", *AHEAD)
    served: dict[int, set[str]] = {}
    addresses: set[str] = set()
    while proc.poll() is None:
        ranks = descendants(proc.pid) - {proc.pid}
        addresses |= set(listeners_of(ranks | {proc.pid}))
        for pid, mine in self_served(ranks).items():
            served.setdefault(pid, set()).update(mine)
        time.sleep(0.1)
    output = proc.communicate()[0]
    assert proc.returncode == 0, output
    assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
    endpoints = [mine for mine in served.values() if mine]
    assert len(endpoints) == 2 and all(len(e) == 1 for e in endpoints), served
    assert endpoints[0] != endpoints[1], served
    one, two = _trained(ahead)[:2], _trained(tmp_path)
    same = ("data/item_ids", "reward/mean", "env/turns", "env/tool_calls",
            "rollout/staleness_max")
    assert len(two) == 2
    assert [[r[k] for k in same] for r in one] == [[r[k] for k in same] for r in two]
    for a, b in zip(one, two, strict=True):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= FLOAT32_LAYOUT_REL * abs(a["grad_norm"])
        scale = max(abs(a["loss"]), a["adv_abs_mean"])
        assert abs(a["loss"] - b["loss"]) <= FLOAT32_LAYOUT_REL * scale, (a, b)


# --- a rewritten history, split (env.on_rewrite = "split") ---------------------------------------


def test_a_rewritten_history_is_split_into_segments_the_policy_scores_as_the_engine(engine):
    """The agent asks, then sends an edited history. Split: the second call starts a segment
    whose prompt is the template's rendering of the edited messages (untrained), after the
    first reply; collated, the segment attends to itself only and its positions restart, so
    the policy's logprobs of both replies are the engine's (within 1e-4), while the same row
    read as one sequence gives the second reply other logprobs. Refused by default."""
    from runner.models import load_causal_lm
    from runner.packers.base import RLPolicyInput
    from runner.train.roles.policy import batch_logprobs

    packer, _ = engine
    [r], _ = play(engine, "tests.extmods.agents.rewrites", "env.on_rewrite=split", n=1)
    assert r.stats["rewrites"] == 1.0 and r.stats["turns"] == 2.0 and r.env_reward == 1.0
    c = r.completion
    [start] = c.segments
    edited = [{"role": "user", "content": A.ASK + " Think."}, dict(r.messages[1]),
              {"role": "user", "content": "Again."}]
    second = packer.render_messages(edited, None, True)
    assert list(c.token_ids[start:start + len(second)]) == second
    assert r.loss_mask[:start] == (1,) * start and not any(r.loss_mask[start:start + len(second)])
    assert all(r.loss_mask[start + len(second):])
    n = len(r.prompt_ids)
    ids, mask = r.prompt_ids + c.token_ids, (0,) * n + r.loss_mask
    model = load_causal_lm(builtin_folder("tiny-arith-tools"))
    split = RLPolicyInput(ids, mask, n, segments=(n + start,))
    engine_lp = torch.tensor((0.0,) * n + c.logprobs)[1:]
    with torch.no_grad():
        lp, m = batch_logprobs(model, packer.collate([split]), 1.0)
        whole, _ = batch_logprobs(model, packer.collate([attrs.evolve(split, segments=())]),
                                  1.0)
    assert float(((lp[0] - engine_lp).abs() * m[0]).max()) < 1e-4
    assert float(((whole[0] - engine_lp).abs() * m[0]).max()) > 0.1
    with pytest.raises(RuntimeFailure, match="env.on_rewrite = 'split' trains such a call"):
        play(engine, "tests.extmods.agents.rewrites", n=1)


def test_grpo_trains_split_episodes_on_the_engines_tokens(tmp_path):
    """A GRPO step whose agent rewrites every episode's history, split: the trained rows
    re-score to the engine's logprobs (``rollout/logprob_gap``), every episode counted."""
    done = run_cli(AGENT, tmp_path, "run.max_steps=1", "algo.prompts_per_step=2",
                   "algo.group_size=2", "data.validation.enabled=false", "logging.sample_every=0",
                   "env.agent=tests.extmods.agents.rewrites", "env.agent_kwargs={}",
                   "env.on_rewrite=split")
    assert done.returncode == 0, done.stdout + done.stderr
    [row] = _trained(tmp_path)
    assert row["env/rewrites"] == 1.0 and row["env/turns"] == 2.0
    assert row["rollout/logprob_gap"] < 1e-4 and math.isfinite(row["loss"])


def test_split_episodes_cross_checkpoints_and_ranks_with_their_segments():
    """A split episode's segment starts survive what carries completions: a batch sampled
    ahead, written into a checkpoint and read back; a dynamic-sampling group crossing ranks."""
    from runner.rollout.base import Completion
    from runner.train.loops.dynamic import Group
    from runner.train.loops.pipeline import Produced
    from runner.train.loops.trajectory import Trajectory

    split = Completion((5, 6, 2, 7, 8, 9, 2), "x", (-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5),
                       "stop", (3,))
    plain = Completion((5, 2), "y", (-0.1, -0.2), "stop")
    traj = Trajectory((ITEM, ITEM), ((1, 3), (1, 3)), (split, plain),
                      loss_masks=((1, 1, 1, 0, 0, 1, 1), (1, 1)), env_rewards=(1.0, 0.0))
    back = Produced.from_json(Produced(3, 2, traj, (0, 0), 1.0).to_json(), lambda i: ITEM).traj
    assert back.completions == (split, plain)
    group = Group(0, traj.prompt_ids, traj.completions, (1.0, 0.0), traj.loss_masks,
                  traj.env_rewards)
    assert Group.from_plain(group.to_plain()) == group
