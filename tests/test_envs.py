"""[env]: multi-turn episodes and tools.

Most tests play episodes with a scripted engine (its replies are chosen by the test), so every
token of an episode is known in advance: the engine's tokens must appear as they were generated
(never re-tokenised), the environment's as the chat template renders them, and the loss mask on
exactly the engine's. The end-to-end tests train the tiny model with the real engines.
"""

from __future__ import annotations

import json

import pytest
import torch

from runner.envs.episodes import EnvRunner
from runner.envs.tools import MAX_TOOL_RESULT_CHARS, ToolBox, ToolResult, cut_text, tool_schema
from runner.errors import RecipeError, RuntimeFailure
from runner.models.builtin import builtin_folder
from runner.packers.chat import ToolCall, parse_hermes_tool_calls
from runner.packers.decoder_only import DecoderOnlyLLMDataPacker
from runner.recipe import load_recipe
from runner.rollout.base import Completion, RolloutOutput, SamplingConfig
from runner.types import ObsBundle
from tests.conftest import REPO
from tests.episode_checks import Recording, check_token_exact
from tests.extmods import envs as E

ITEM = ObsBundle("What is 17 - 3?", reference="14", id="q17")


@pytest.fixture(scope="module")
def packer():
    p = DecoderOnlyLLMDataPacker()
    p.setup(str(builtin_folder("tiny-arith")))
    return p


@pytest.fixture(scope="module")
def tool_packer():
    p = DecoderOnlyLLMDataPacker()
    p.setup(str(builtin_folder("tiny-arith-tools")))
    return p


def ids(packer, text):
    return packer.encode_rollout_input(text)


class Scripted:
    """Replies with the next of ``replies`` (token ids) to every prompt of every call, in
    order; records (prompt, max_new_tokens, seed, reply) per prompt. Logprobs are -0.01 x
    (call number + 1) per token, so each turn's are told apart."""

    name, shared = "scripted", False

    def __init__(self, replies):
        self.replies = list(replies)
        self.calls = []

    def generate(self, prompts, sampling, seeds=None):
        outs = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            reply = list(self.replies.pop(0))[:sampling.max_new_tokens]
            lp = [-0.01 * (len(self.calls) + 1)] * len(reply)
            finish = "stop" if reply and reply[-1] == 2 else "length"
            self.calls.append((list(prompt), sampling.max_new_tokens, seed, reply))
            outs.append(RolloutOutput(tuple(prompt), (Completion(tuple(reply), "", tuple(lp),
                                                                 finish),)))
        return outs


def runner_for(packer, *overrides, factory=None):
    recipe = load_recipe(REPO / "recipes" / "grpo-arith.toml", list(overrides))
    from runner.envs.build import load_factory, load_tools

    return EnvRunner(recipe.env, packer, factory or load_factory(recipe.env),
                     ToolBox(load_tools(recipe.env), recipe.env.tool_timeout_s), recipe.model.path)


def play(runner, engine, n=1, items=(ITEM,), max_new_tokens=16):
    return runner.play(engine.generate, lambda *a: None, list(items),
                       SamplingConfig(n=n, max_new_tokens=max_new_tokens), [123] * len(items))


def render(packer, messages, gen):
    tok = packer.tokenizer
    return ids(packer, tok.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=gen))


def test_episode_tokens_are_the_engines_plus_the_templates_rendering(packer):
    """Turn 1 replies '16' spelled as two digit tokens, which the tokenizer would write as one
    token: the episode keeps the engine's two. The environment's answer is the template's
    rendering of it after the conversation so far; only the engine's tokens are trained."""
    one, six, four = (packer.tokenizer.convert_tokens_to_ids(d) for d in "164")
    eos = packer.eos_token_id
    assert ids(packer, "16") != [one, six]  # so re-tokenising the reply would change it
    engine = Scripted([[one, six, eos], [one, four, eos]])
    (ep,) = play(runner_for(packer, "env.factory=tests.extmods.envs.retry"), engine)
    user = [{"role": "user", "content": ITEM.prompt}]
    wrong = [*user, {"role": "assistant", "content": "16"}]
    env_part = (render(packer, [*wrong, {"role": "user", "content": "Wrong, try again."}], True)
                [len(render(packer, wrong, False)):])
    assert ep.prompt_ids == tuple(render(packer, user, True))
    assert list(ep.completion.token_ids) == [one, six, eos, *env_part, one, four, eos]
    assert ep.loss_mask == (1, 1, 1, *[0] * len(env_part), 1, 1, 1)
    assert ep.completion.logprobs == (-0.01,) * 3 + (0.0,) * len(env_part) + (-0.02,) * 3
    assert ep.completion.text == "14" and ep.env_reward == pytest.approx(-0.25 + 1.0)
    assert ep.stats == {"turns": 2.0, "tool_calls": 0.0, "tool_failures": 0.0,
                        "truncated": 0.0, "solved": 1.0}
    # Each turn was sampled from exactly the episode's tokens so far, with its own seed.
    assert engine.calls[0][0] == list(ep.prompt_ids)
    assert engine.calls[1][0] == [*ep.prompt_ids, one, six, eos, *env_part]
    assert engine.calls[0][2] != engine.calls[1][2]


def test_policy_input_masks_exactly_the_engines_tokens(packer):
    from runner.train.loops.rollouts import episodes_trajectory

    one, four = (packer.tokenizer.convert_tokens_to_ids(d) for d in "14")
    engine = Scripted([[one, one, 2], [one, four, 2]])
    results = play(runner_for(packer, "env.factory=tests.extmods.envs.retry"), engine)
    (x,) = episodes_trajectory([ITEM], 1, results).policy_inputs(packer)
    n = x.n_prompt_tokens
    assert x.input_ids == results[0].prompt_ids + results[0].completion.token_ids
    assert x.loss_mask == (0,) * n + results[0].loss_mask
    batch = packer.collate([x])
    assert batch.loss_mask_BT[0, n:].tolist() == list(results[0].loss_mask)


class AppendBreaker(DecoderOnlyLLMDataPacker):
    """Renders the number of messages first: every longer conversation changes token 1."""

    def render_messages(self, messages, tools=None, add_generation_prompt=False):
        return [1, 10 + len(messages)] + super().render_messages(messages, tools,
                                                                  add_generation_prompt)[1:]


class OwnRenderer(DecoderOnlyLLMDataPacker):
    def env_message_ids(self, conversation, new_messages, tools=None):
        return [7, 7, 7]


def test_a_template_that_is_not_append_only_is_refused_naming_model_and_turn():
    packer = AppendBreaker()
    packer.setup(str(builtin_folder("tiny-arith")))
    engine = Scripted([[3 + 10, 2]])
    with pytest.raises(RecipeError, match=r"builtin:tiny-arith: the chat template is not "
                       r"append-only at turn 0 of item 'q17'.*token 1"):
        play(runner_for(packer, "env.factory=tests.extmods.envs.retry"), engine)


def test_a_message_the_template_cannot_render_is_refused_in_one_line(packer):
    """tiny-arith's template knows system, user and assistant only."""
    run = runner_for(packer, "env.factory=tests.extmods.envs.answers_as_tool")
    with pytest.raises(RecipeError, match=r"builtin:tiny-arith: the chat template cannot render "
                       r"the answer at turn 0 of item 'q17': TemplateError: roles must be"):
        play(run, Scripted([[20, 2]]))


def test_a_packers_own_renderer_is_used():
    packer = OwnRenderer()
    packer.setup(str(builtin_folder("tiny-arith")))
    engine = Scripted([[20, 2], [21, 2]])
    (ep,) = play(runner_for(packer, "env.factory=tests.extmods.envs.retry", "env.max_turns=2"),
                 engine)
    assert ep.completion.token_ids == (20, 2, 7, 7, 7, 21, 2)
    assert ep.loss_mask == (1, 1, 0, 0, 0, 1, 1)


def test_max_turns_and_max_total_tokens_truncate(packer):
    one = packer.tokenizer.convert_tokens_to_ids("1")
    run = runner_for(packer, "env.factory=tests.extmods.envs.retry", "env.max_turns=2")
    (ep,) = play(run, Scripted([[one, 2], [one, 2]]))
    assert ep.stats["turns"] == 2 and ep.stats["truncated"] == 1.0
    assert ep.completion.token_ids[-2:] == (one, 2)  # ends on its last turn, no env answer
    # A budget of prompt + 5 tokens: turn 1 (2 tokens) fits, the env's answer does not.
    limit = len(ep.prompt_ids) + 5
    run = runner_for(packer, "env.factory=tests.extmods.envs.retry",
                     f"env.max_total_tokens={limit}")
    (ep,) = play(run, Scripted([[one, 2]]))
    assert ep.completion.token_ids == (one, 2) and ep.stats["truncated"] == 1.0
    # A turn cut by the budget (no eos) ends the episode; the engine was asked for no more.
    engine = Scripted([[one] * 9 + [2]])
    (ep,) = play(runner_for(packer, "env.factory=tests.extmods.envs.retry",
                            f"env.max_total_tokens={len(ep.prompt_ids) + 4}"), engine)
    assert engine.calls[0][1] == 4 and ep.completion.token_ids == (one,) * 4
    assert ep.completion.finish_reason == "length" and ep.stats["truncated"] == 1.0


# --- tools -----------------------------------------------------------------------------------

def test_tool_schema_and_parsing():
    assert tool_schema(E.mul) == {"type": "function", "function": {
        "name": "mul", "description": "Multiply two integers.", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}}
    text = ('Let me see. <tool_call>{"name": "mul", "arguments": {"a": 3, "b": 4}}</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {"a": 3,}}</tool_call>'
            '<tool_call>["mul"]</tool_call><tool_call>{"name": "mul", "arguments": "{\\"a\\": 1}"}'
            '</tool_call>')
    good, bad_json, not_object, string_args = parse_hermes_tool_calls(text)
    assert good == ToolCall("mul", {"a": 3, "b": 4})
    assert bad_json.error.startswith("the call is not valid JSON")
    assert not_object.error == 'the call is not an object with a "name" string'
    assert string_args == ToolCall("mul", {"a": 1})
    assert parse_hermes_tool_calls("no call here") == []


def test_tool_calls_that_fail_become_messages():
    box = ToolBox({"mul": E.mul, "sleepy": E.sleepy, "divide": E.divide}, timeout_s=0.3)
    assert box.call(ToolCall("mul", {"a": 6, "b": 7})).content == "42"
    assert box.call(ToolCall("", error="the call is not valid JSON")).content == \
        "error: the call is not valid JSON"
    unknown = box.call(ToolCall("pow", {"a": 1}))
    assert unknown.failed and unknown.content == ("error: unknown tool 'pow'; the tools are "
                                                  "mul, sleepy, divide")
    wrong = box.call(ToolCall("mul", {"a": 1, "c": 2}))
    assert wrong.failed and wrong.content == "error: mul: missing a required argument: 'b'"
    slow = box.call(ToolCall("sleepy", {"seconds": 30}))
    assert slow.failed and slow.content == "error: sleepy timed out after 0.3 s"
    raised = box.call(ToolCall("divide", {"a": 1, "b": 0}))
    assert raised.failed and raised.content == ("error: divide raised ZeroDivisionError: "
                                                "division by zero")


def test_a_tool_episode_goes_on_after_a_failed_call(tool_packer):
    """The built-in tool environment: a malformed call gets an error message, a good one its
    result, and the reply that calls no tool ends the episode."""
    bad = '<tool_call>{"name": "mul", "arguments": {"a": 6}}</tool_call>'
    good = '<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>'
    packer = tool_packer
    replies = [ids(packer, bad) + [2], ids(packer, good) + [2], ids(packer, "42") + [2]]
    engine = Scripted(replies)
    run = runner_for(tool_packer, "env.tools=[\"tests.extmods.envs.mul\"]")
    (ep,) = play(run, engine, max_new_tokens=128)
    tool_msgs = [m for m in ep.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == ["error: mul: missing a required argument: 'b'",
                                                 "42"]
    assert ep.stats == {"turns": 3.0, "tool_calls": 2.0, "tool_failures": 1.0,
                        "truncated": 0.0}
    assert ep.completion.text == "42" and sum(ep.loss_mask) == sum(len(r) for r in replies)


def test_a_tool_result_that_cannot_be_rendered_becomes_a_tool_message():
    """The conversion to text runs inside the guard: a result whose str() raises, one nested
    beyond the recursion limit, and an exception whose str() raises each become an error
    message; a lone surrogate is replaced (U+FFFD), not fatal."""
    box = ToolBox({"unprintable": E.unprintable, "deep": E.deep, "surrogate": E.surrogate,
                   "raises_unprintable": E.raises_unprintable}, timeout_s=5.0)
    bad = box.call(ToolCall("unprintable", {}))
    assert bad.failed and bad.content == ("error: unprintable returned a _NoText that cannot be "
                                          "rendered as text: ValueError: no text for you")
    deep = box.call(ToolCall("deep", {}))
    assert deep.failed and deep.content.startswith(
        "error: deep returned a list that cannot be rendered as text: RecursionError: ")
    assert box.call(ToolCall("surrogate", {})) == ToolResult("x\ufffdy", False)
    raised = box.call(ToolCall("raises_unprintable", {}))
    assert raised.failed and raised.content == ("error: raises_unprintable raised _Unspeakable "
                                                "(its message cannot be rendered)")


def test_an_episode_goes_on_after_tool_results_that_cannot_be_rendered(tool_packer):
    calls = "".join(f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>'
                    for n in ("surrogate", "unprintable", "deep"))
    replies = [ids(tool_packer, calls) + [2], ids(tool_packer, "42") + [2]]
    run = runner_for(tool_packer, "env.tools=[\"tests.extmods.envs.surrogate\", "
                     "\"tests.extmods.envs.unprintable\", \"tests.extmods.envs.deep\"]")
    (ep,) = play(run, Scripted(replies), max_new_tokens=256)
    tool_msgs = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert tool_msgs[0] == "x\ufffdy" and len(tool_msgs) == 3
    assert ep.stats["turns"] == 2.0 and ep.stats["tool_failures"] == 2.0
    assert ep.completion.text == "42"


def test_a_huge_tool_result_is_cut_to_a_fixed_number_of_characters():
    out = ToolBox({"huge": E.huge}, timeout_s=30.0).call(ToolCall("huge", {"n": 50_000_000}))
    marker = "\n[cut: 50,000,000 characters in all]"
    assert out == ToolResult("7" * (MAX_TOOL_RESULT_CHARS - len(marker)) + marker, False)


class Spy(DecoderOnlyLLMDataPacker):
    """Records the most characters of one message it was asked to render."""

    longest = 0

    def env_message_ids(self, conversation, new_messages, tools=None):
        Spy.longest = max([Spy.longest, *(len(m["content"]) for m in new_messages)])
        return super().env_message_ids(conversation, new_messages, tools)


@pytest.mark.parametrize("overrides", [
    ("env.tools=[\"tests.extmods.envs.huge\"]",),
    ("env.tools=[\"tests.extmods.envs.huge\"]", "env.factory=tests.extmods.envs.huge_answer")])
def test_what_the_context_cannot_hold_is_never_tokenised(overrides):
    """A tool's result is cut to the characters the episode's remaining tokens can spell (the
    tokens left times the longest vocabulary entry, 16 characters here); an environment's
    answer beyond them ends the episode (truncated) unrendered."""
    packer = Spy()
    packer.setup(str(builtin_folder("tiny-arith-tools")))
    Spy.longest = 0
    reply = ('<tool_call>{"name": "huge", "arguments": {"n": 300000}}</tool_call>'
             if len(overrides) == 1 else "12")
    (ep,) = play(runner_for(packer, *overrides), Scripted([ids(packer, reply) + [2]]),
                 max_new_tokens=256)
    room = 512 - len(ep.prompt_ids) - len(ids(packer, reply)) - 1
    assert ep.stats["truncated"] == 1.0
    assert Spy.longest == (room * 16 if len(overrides) == 1 else 0)
    assert cut_text("7" * 300_000, room * 16).endswith("\n[cut: 300,000 characters in all]")


# --- the environment's failures: one line naming its path, the item and the turn ------------

@pytest.mark.parametrize("factory, message", [
    ("returns_dict", r"step\(\) returned a dict .*, not a runner.envs.EnvStep \(item 'q17', "
                     r"turn 0\)"),
    ("returns_bad_role", r"step\(\) returned a list .* with role user or tool \(item 'q17', "
                         r"turn 0\)"),
    ("raises_in_step", r"step\(\) raised KeyError: 'no such door' \(item 'q17', turn 0\)"),
    ("not_an_env", r"the factory returned a int, which has no reset\(\) method"),
    ("done_is_a_string", r"step\(\) returned done = a str \('no'\), not a bool \(item 'q17', "
                         r"turn 0\)"),
    ("info_names_turns", r"step\(\) returned info\['turns'\], a name the runner logs itself "
                         r"\(env/turns\); rename it \(item 'q17', turn 0\)"),
    ("info_not_a_dict", r"step\(\) returned info = a list \(\[\('solved', 1.0\)\]\), not a dict "
                        r"of numbers by name \(item 'q17', turn 0\)"),
    ("info_too_big", r"step\(\) returned info\['score'\] = an integer of about 401 digits, not "
                     r"a finite number \(item 'q17', turn 0\)"),
    ("reward_beyond_float32", r"step\(\) returned the reward 1e\+308, beyond the largest reward "
                              r"\(1e\+15 in magnitude\) \(item 'q17', turn 0\)"),
    ("rewards_that_add_up", r"the episode's env reward \(its turns' sum\) is 1.8e\+15, beyond the "
                            r"largest reward \(1e\+15 in magnitude\) \(item 'q17', turn 1\)"),
])
def test_an_environment_that_breaks_its_contract_is_named(packer, factory, message):
    run = runner_for(packer, f"env.factory=tests.extmods.envs.{factory}")
    with pytest.raises(RuntimeFailure, match=rf"^env: tests.extmods.envs.{factory}: {message}"):
        play(run, Scripted([[20, 2], [20, 2]]))


def test_numpy_numbers_and_booleans_are_accepted(packer):
    (ep,) = play(runner_for(packer, "env.factory=tests.extmods.envs.done_as_numpy"),
                 Scripted([[20, 2]]))
    assert (ep.env_reward, ep.stats["found"], ep.stats["truncated"]) == (0.5, 1.0, 0.0)


def test_an_environment_that_never_returns_is_named(packer):
    run = runner_for(packer, "env.factory=tests.extmods.envs.hangs_in_step",
                     "env.step_timeout_s=0.2")
    with pytest.raises(RuntimeFailure, match=r"hangs_in_step: step\(\) did not return within "
                       r"0.2 s \(env.step_timeout_s\) \(item 'q17', turn 0\)"):
        play(run, Scripted([[20, 2]]))


def test_validate_names_a_bad_factory_path_and_kwargs_that_do_not_bind(run_cli):
    rc, out, err = run_cli("recipes/grpo-arith.toml", "--validate",
                           "env.factory=tests.extmods.envs.nowhere",
                           "env.tools=[\"tests.extmods.envs.mul\", \"tests.extmods.nope.add\"]")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2, err
    assert "env.factory: tests.extmods.envs.nowhere: 'tests.extmods.envs' has no attribute " \
           "'nowhere'" in lines[0]
    assert "env.tools[1]: tests.extmods.nope.add: 'tests.extmods' has no attribute 'nope'" \
        in lines[1]
    rc, out, err = run_cli("recipes/grpo-arith.toml", "--validate",
                           "env.factory=tests.extmods.envs.retry", "env.factory_kwargs={tries=2}")
    assert rc == 2 and "env.factory: tests.extmods.envs.retry: cannot be called with these " \
                       "arguments: got an unexpected keyword argument 'tries'" in err, err


def test_env_keys_are_checked(run_cli):
    rc, _, err = run_cli("recipes/dpo-arith.toml", "--validate", "env.tools=[\"a.b\"]",
                         "env.max_turns=0")
    assert rc == 2
    assert "env.tools: DPO trains on given pairs and plays no episodes" in err
    assert "env.max_turns: must be in [1, 1024] (got 0)" in err


# --- losses on a two-turn trajectory ----------------------------------------------------------

def test_grpo_loss_of_a_two_turn_episode_by_hand():
    """Tokens: assistant a1 a2, environment e1 e2, assistant a3. Policy logprobs against old
    ones give ratios (2, 1, ., ., 0.5); advantage 1, clip 0.2, token_mean over the 3 trained
    tokens: min(r A, clip(r) A) = (1.2, 1, 0.5) -> loss = -(1.2 + 1 + 0.5) / 3 = -0.9. The
    environment's tokens (ratios 10 and 0.01) must not count."""
    from runner.algorithms.grpo import GRPOLossInputs, grpo_loss
    from runner.recipe.schema import GRPOConfig

    ratios = torch.tensor([[2.0, 1.0, 10.0, 0.01, 0.5]], dtype=torch.float64)
    old = torch.full_like(ratios, -1.0)
    mask = torch.tensor([[1, 1, 0, 0, 1]]).bool()
    loss, _ = grpo_loss(GRPOLossInputs(logprobs_BT=old + ratios.log(), old_logprobs_BT=old,
                                       adv_B=torch.tensor([1.0], dtype=torch.float64),
                                       ref_logprobs_BT=None, mask_BT=mask, max_tokens=8),
                        GRPOConfig())
    assert float(loss) == pytest.approx(-0.9, abs=1e-12)


# --- runs ----------------------------------------------------------------------------------------

def test_episodes_do_not_depend_on_the_batch_they_are_played_in(tmp_path):
    """With the hf engine: every episode is token-exact (``check_token_exact``); seeded per item
    and turn, items played together or apart give the same episodes (so any number of ranks
    plays the same ones)."""
    from tests.tiny_run import tiny_run

    items = [ObsBundle(f"What is {a} + {b}?", reference=str(a + b)) for a, b in
             ((3, 4), (12, 9), (5, 5))]
    with tiny_run("grpo-arith", tmp_path, "env.factory=tests.extmods.envs.retry",
                  "reward.functions=[]") as run:
        params = SamplingConfig(n=2, max_new_tokens=4)
        engine = run.rollout.engine
        run.rollout.engine = recording = Recording(engine)
        together = run.rollout.play(items, params, [11, 22, 33])
        run.rollout.engine = engine
        check_token_exact(together, recording.calls, run.rollout.packer, [11, 22, 33], 2)
        apart = [r for item, s in zip(items, [11, 22, 33], strict=True)
                 for r in run.rollout.play([item], params, [s])]
    # The same tokens, rewards and stats; the logprobs within float noise (a padded batch's
    # arithmetic differs in the last bits from one row's, as in single-turn rollouts).
    for a, b in zip(together, apart, strict=True):
        assert (a.prompt_ids, a.completion.token_ids, a.loss_mask, a.env_reward, a.stats) == \
            (b.prompt_ids, b.completion.token_ids, b.loss_mask, b.env_reward, b.stats)
        assert a.completion.logprobs == pytest.approx(b.completion.logprobs, abs=1e-5)
    assert any(r.stats["turns"] > 1 for r in together)


RUN = ("recipes/grpo-arith.toml", "env.factory=tests.extmods.envs.retry", "env.max_turns=3",
       "reward.functions=[]", "algo.prompts_per_step=4", "algo.group_size=4", "run.max_steps=2",
       "data.validation.enabled=false", "checkpoint.every_steps=1", "logging.item_ids=true")


def rows(folder):
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in lines]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The multi-turn GRPO run of ``RUN``, 2 steps in one go on one rank."""
    from tests.multiproc import run_ranks

    out = tmp_path_factory.mktemp("env-run") / "a"
    done = run_ranks(RUN[0], out, 1, *RUN[1:])
    assert done.returncode == 0, done.stderr
    return out


def test_a_multi_turn_run_trains_and_resumes_bitwise(straight, tmp_path, run_cli):
    """GRPO with the retry environment: 2 steps, against 1 step and a resume to 2."""
    assert run_cli(*RUN, f"run.output_dir={tmp_path / 'b'}", "run.max_steps=1")[0] == 0
    assert run_cli(*RUN, f"run.output_dir={tmp_path / 'b'}")[0] == 0
    a, b = rows(straight), rows(tmp_path / "b")
    assert a == b and a[-1]["env/turns"] > 1
    assert {"env/turns", "env/truncated", "env/solved", "reward/env"} <= set(a[-1])
    from safetensors.torch import load_file

    wa = load_file(straight / "checkpoints/step-000002/model/model.safetensors")
    wb = load_file(tmp_path / "b/checkpoints/step-000002/model/model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.multiproc
def test_two_ranks_play_the_same_episodes_as_one(straight, tmp_path):
    """torchrun x 2: the same items as the one-rank run, and at step 1 (the same weights) the
    same episodes. (Later steps sample with weights that differ in their last bits between the
    layouts, which could flip a sample on some CPU: only the items are compared there.)"""
    from tests.multiproc import run_ranks

    done = run_ranks(RUN[0], tmp_path / "two", 2, *RUN[1:])
    assert done.returncode == 0, done.stderr
    two, one = rows(tmp_path / "two"), rows(straight)
    assert [r["data/item_ids"] for r in two] == [r["data/item_ids"] for r in one]
    keys = ("env/turns", "env/truncated", "env/solved", "reward/mean", "reward/max")
    assert [two[0][k] for k in keys] == [one[0][k] for k in keys]


def test_an_environment_that_raises_ends_the_run_in_one_line(run_cli, tmp_path):
    rc, _, err = run_cli("recipes/grpo-arith.toml", f"run.output_dir={tmp_path}",
                         "env.factory=tests.extmods.envs.raises_in_step", "reward.functions=[]",
                         "data.validation.enabled=false", "algo.prompts_per_step=2",
                         "algo.group_size=2")
    assert rc == 1
    assert err.strip().splitlines()[-1] == (
        "error: env at step 1: tests.extmods.envs.raises_in_step: step() raised KeyError: "
        "'no such door' (row 1535 of built-in arithmetic (train), turn 0)")


def test_dry_run_plays_one_episode_and_shows_the_trained_spans(run_cli):
    rc, out, err = run_cli("recipes/grpo-arith.toml", "--dry-run", "--plain",
                           "env.factory=tests.extmods.envs.retry", "env.max_turns=2",
                           "reward.functions=[]")
    assert rc == 0, err
    section = out[out.index("One episode (played with the current model)"):]
    assert "tests.extmods.envs.retry" in section and "'What is 17 - 3?'" in section
    assert "trained (assistant)" in section and "not trained (environment)" in section
    assert "0 tool call(s)" in section and "env reward" in section


def test_a_packer_that_does_not_render_chat_is_refused():
    from runner.envs.build import build_env_runner
    from runner.packers.qwen3_vl import Qwen3VLDataPacker

    recipe = load_recipe(REPO / "recipes" / "grpo-vl.toml",
                         ["env.factory=tests.extmods.envs.retry"])
    with pytest.raises(RecipeError, match=r"model.path: Qwen3VLDataPacker does not render chat "
                       r"conversations"):
        build_env_runner(recipe, Qwen3VLDataPacker())


def test_eval_plays_the_held_out_episodes(straight, tmp_path, run_cli):
    """posttrain-run eval with [env]: each prompt's episodes in eval.json, and the metrics are
    their means (recomputed here)."""
    rc, _, err = run_cli("eval", *RUN, f"run.output_dir={straight}", "--checkpoint", "latest",
                         "data.validation.enabled=true", "data.validation.size=6",
                         "eval.num_samples=2", "eval.temperature=1.0", "--out", str(tmp_path))
    assert rc == 0, err
    result = json.loads((tmp_path / "eval.json").read_text())
    episodes = [e for item in result["items"] for e in item["episodes"]]
    env = [v for item in result["items"] for v in item["reward_of"]["env"]]
    assert len(episodes) == len(env) == 12
    m = result["metrics"]
    assert m["env/turns"] == pytest.approx(sum(e["turns"] for e in episodes) / 12, abs=1e-12)
    assert m["reward/env"] == pytest.approx(sum(env) / 12, abs=1e-12) == \
        pytest.approx(m["reward"], abs=1e-12)
    assert all(1 <= e["turns"] <= 3 for e in episodes)
