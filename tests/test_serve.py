"""``posttrain-run serve``: the real CLI serving a checkpoint of a (one-step) run of the
tool-calling tiny model, asked by the real openai client (and plain HTTP where the client hides
what is sent).

What a caller gets is checked against transformers directly, not against the runner's own code:
the prompt's ids are the tokenizer's chat template of the messages, the completion's ids decode
to its text, and their logprobs are the model's own (one forward of prompt + completion).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.multiproc import descendants, listeners_of
from tests.resume_helpers import CLI, _env, run_cli

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

RECIPE = "recipes/grpo-tools.toml"
MODEL = REPO / "runner" / "models" / "shipped" / "tiny-arith-tools"
KEY = "test-key-1"
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    for name in ("add", "mul")]
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Server:
    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url
        self.client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)

    def post(self, path: str, data: bytes, key: str | None = KEY) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


TRAIN = ("run.max_steps=1", "algo.prompts_per_step=4", "algo.group_size=4",
         "data.validation.enabled=false", "logging.sample_every=0")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of one step: the model served is its checkpoint, not the base model."""
    out = tmp_path_factory.mktemp("serve")
    done = run_cli(RECIPE, out, *TRAIN)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def server(trained):
    proc = subprocess.Popen([*CLI[:3], "serve", RECIPE, "--checkpoint", "latest", "--port", "0",
                             "--api-key", KEY, f"run.output_dir={trained}", *TRAIN],
                            cwd=REPO, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    line = proc.stdout.readline()
    deadline = time.monotonic() + 120
    while "serving" not in line and proc.poll() is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:\d+/v1", line)
    assert match, line + (proc.stdout.read() if proc.poll() is not None else "")
    assert f"(api key: {KEY})" in line
    family = descendants(proc.pid)
    yield Server(proc, match.group(0))
    proc.send_signal(signal.SIGINT)  # what Ctrl-C does
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, rest
    assert "Traceback" not in rest, rest
    assert not [p for p in family if Path(f"/proc/{p}").exists()], family  # nothing left


@pytest.fixture(scope="module")
def reference(trained):
    """The checkpoint's model and the base model's tokenizer as transformers loads them, for
    independent checks; the checkpoint's weights are not the base model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = trained / "checkpoints" / "step-000001" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters(),
                                                      strict=True))
    return model, AutoTokenizer.from_pretrained(MODEL)


def _template(tok, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def _logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_chat_answers_the_engines_exact_tokens_and_the_models_logprobs(server, reference):
    model, tok = reference
    messages = [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "What is 12 + 34?"}]
    r = server.client.chat.completions.create(model="any-name", messages=messages, n=3, seed=7,
                                              temperature=1.0, max_tokens=12, logprobs=True)
    assert r.model == "grpo-tools/step-000001" and r.object == "chat.completion"
    assert len(r.choices) == 3
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt == _template(tok, messages)
    total = 0
    for choice in r.choices:
        ids = choice.model_extra["token_ids"]
        total += len(ids)
        assert choice.finish_reason in ("stop", "length")
        assert (ids[-1] == tok.eos_token_id) == (choice.finish_reason == "stop")
        assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
        got = [t.logprob for t in choice.logprobs.content]
        want = _logprobs(model, prompt, ids)
        assert len(got) == len(ids)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        assert [t.token for t in choice.logprobs.content] == [tok.decode([i]) for i in ids]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), total)

    # The same seed answers the same, alone or batched with other requests in one engine call.
    def ask(seed: int):
        return server.client.chat.completions.create(
            model="x", messages=messages, n=3, seed=seed, temperature=1.0, max_tokens=12)

    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(ask, [7, 8, 7, 9]))
    for answer in (again[0], again[2]):
        assert [c.model_extra["token_ids"] for c in answer.choices] == [
            c.model_extra["token_ids"] for c in r.choices]


def test_tool_calls_come_back_in_the_openai_shape_and_render_back(server, reference):
    _, tok = reference
    ask = [{"role": "user", "content": "What is 21 + 77?"}]
    r = server.client.chat.completions.create(model="x", messages=ask, tools=TOOLS, n=16,
                                              seed=1, temperature=1.0, max_tokens=32)
    called = [c for c in r.choices if c.message.tool_calls]
    assert called, [c.message.content for c in r.choices]  # the model calls tools now and then
    for choice in r.choices:
        text = tok.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
        written = [json.loads(m) for m in CALL.findall(text)]
        calls = choice.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (w["name"], w["arguments"]) for w in written]
        if calls:
            assert choice.finish_reason == "tool_calls"
            rest = CALL.sub("", text).strip()
            assert choice.message.content == (rest or None)
            assert len({c.id for c in calls}) == len(calls)

    # Streamed, the same answers arrive as chunks: the tool calls whole, then the finish reason.
    chunks = list(server.client.chat.completions.create(
        model="x", messages=ask, tools=TOOLS, n=16, seed=1, temperature=1.0, max_tokens=32,
        stream=True))
    streamed: dict[int, list] = {}
    finished: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.delta.tool_calls or [])
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    for i, choice in enumerate(r.choices):
        calls = choice.message.tool_calls or []
        assert [(t.function.name, t.function.arguments) for t in streamed[i]] == [
            (t.function.name, t.function.arguments) for t in calls]
        assert finished[i] == choice.finish_reason

    # The agent sends the call back with the tool's answer: the model reads the call as it
    # wrote it (the template renders the assistant's text, the call included).
    call = called[0].message.tool_calls[0]
    follow = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "98"}]
    r = server.client.chat.completions.create(model="x", messages=follow, tools=TOOLS,
                                              temperature=0, max_tokens=8)
    args = json.loads(call.function.arguments)
    written = '<tool_call>' + json.dumps({"name": call.function.name, "arguments": args}) + \
        '</tool_call>'
    rendered = [*ask, {"role": "assistant", "content": written},
                {"role": "tool", "content": "98"}]
    assert r.model_extra["prompt_token_ids"] == _template(tok, rendered, TOOLS)


def test_streaming_and_stop_sequences(server):
    messages = [{"role": "user", "content": "What is 37 + 48?"}]
    plain = server.client.chat.completions.create(model="x", messages=messages, temperature=0,
                                                  max_tokens=12)
    chunks = list(server.client.chat.completions.create(
        model="x", messages=messages, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        plain.choices[0].finish_reason)
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens

    first = plain.choices[0].message.content[0]
    cut = server.client.chat.completions.create(model="x", messages=messages, temperature=0,
                                                max_tokens=12, stop=[first])
    assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["token_ids"] == []

    done = server.client.completions.create(model="x", prompt="<|user|>What is 2 + 3?",
                                            temperature=0, max_tokens=6, seed=3)
    ids = done.model_extra["prompt_token_ids"]
    again = server.client.completions.create(model="x", prompt=ids, temperature=0,
                                             max_tokens=6, seed=3)
    assert again.choices[0].text == done.choices[0].text
    assert again.choices[0].model_extra["token_ids"] == done.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature",
     "must be in [0, 2], got 5"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n", "must be in [1, 64]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice", "only 'auto' and 'none'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "only text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}, "max_tokens",
     "must be in [1, "),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, words):
    status, answer = server.post("/chat/completions", json.dumps(body).encode())
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and words in error["message"]


def test_keys_paths_and_bodies_that_are_refused_leave_the_server_answering(server):
    status, answer = server.post("/chat/completions", b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]
    hello = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    for key in (None, "wrong"):
        status, answer = server.post("/chat/completions", hello, key=key)
        assert status == 401 and answer["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
    status, answer = server.post("/embeddings", hello)
    assert status == 404 and "/v1/embeddings" in answer["error"]["message"]
    assert [m.id for m in server.client.models.list().data] == ["grpo-tools/step-000001"]
    listening = listeners_of(descendants(server.proc.pid))
    assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening


def test_a_checkpoint_that_is_not_there_is_one_line_before_any_model(tmp_path):
    done = subprocess.run([*CLI[:3], "serve", RECIPE, "--checkpoint", "latest",
                           f"run.output_dir={tmp_path}"], cwd=REPO, env=_env(), text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()
    assert len(last) == 1 and "checkpoint" in last[0] and "Traceback" not in done.stderr


def test_a_reward_model_recipe_is_not_served(tmp_path):
    done = subprocess.run([*CLI[:3], "serve", "recipes/rm-arith.toml",
                           f"run.output_dir={tmp_path}"], cwd=REPO, env=_env(), text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()
    assert len(last) == 1 and "algo.kind" in last[0] and "score head" in last[0]
