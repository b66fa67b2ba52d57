"""SFT: the loss by hand, token-exact assistant masks for each built-in text model's template,
the refusal of a template that is not append-only, packed = unpacked, the data errors, a short
CLI run and an exact resume after SIGKILLs."""

from __future__ import annotations

import json
import math
import random

import attrs
import pytest
import torch

from runner.algorithms.sft import sft_loss
from runner.data.sources import build_prompt_sources
from runner.errors import RecipeError
from runner.models import load_causal_lm, resolve_model_path
from runner.models.builtin import is_built
from runner.models.home import model_dir
from runner.packers import DecoderOnlyLLMDataPacker, build_packer
from runner.recipe import load_recipe
from runner.train.loops.sft import encode
from runner.train.roles.packing import packed_logprobs
from runner.train.roles.policy import batch_logprobs
from runner.types import ObsBundle
from tests.conftest import REPO
from tests.resume_helpers import assert_same_run, kill_at_random_points, rows
from tests.resume_helpers import run_cli as run_subprocess

CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "9-2="},
        {"role": "assistant", "content": "7"}]
TOOLS_CHAT = [{"role": "system", "content": "Use the tools."},
              {"role": "user", "content": "3+4="},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "content": "7"},
              {"role": "assistant", "content": "7"},
              {"role": "user", "content": "1+1="},
              {"role": "assistant", "content": "2"}]
SMOLLM2 = "smollm2-135m-instruct"


def _tiny(role: str, content: str, eos: str) -> list[tuple[str, bool]]:
    if role == "assistant":
        return [("<|assistant|>", False), (content, True), (eos, True)]
    if role == "tool":
        return [(f"<|user|><tool_response>{content}</tool_response>{eos}", False)]
    return [(f"<|{role}|>{content}{eos}", False)]


def _char(role: str, content: str, eos: str) -> list[tuple[str, bool]]:
    if role == "assistant":
        return [("<assistant>", False), (content, True), (eos, True)]
    return [(f"<{role}>{content}\n", False)]


def _chatml(role: str, content: str, eos: str) -> list[tuple[str, bool]]:
    if role == "assistant":
        return [("<|im_start|>assistant\n", False), (content, True), (eos, True), ("\n", False)]
    return [(f"<|im_start|>{role}\n{content}{eos}\n", False)]


# model -> (how its template writes a message, hand-copied from the template; its bos; the chat)
TEMPLATES = {
    "builtin:tiny-arith": (_tiny, "<|bos|>", CHAT),
    "builtin:tiny-arith-char": (_char, "<s>", CHAT),
    "builtin:tiny-arith-tools": (_tiny, "<|bos|>", TOOLS_CHAT),
    f"builtin:{SMOLLM2}": (_chatml, "", TOOLS_CHAT),
}


def _packer(model: str) -> DecoderOnlyLLMDataPacker:
    if model.endswith(SMOLLM2) and not is_built(model_dir(SMOLLM2)):
        pytest.skip("SmolLM2 is not converted on this machine")
    return build_packer(resolve_model_path(model), "llama" if SMOLLM2 in model else "qwen2")


def expected(model: str, packer, messages: list[dict], loss_on: str) -> tuple[list, list]:
    """Ids and mask from the template written out by hand, each piece encoded on its own."""
    write, bos, _ = TEMPLATES[model]
    eos = packer.tokenizer.eos_token
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    pieces = [(bos, False)] if bos else []
    for i, m in enumerate(messages[:last + 1]):
        content = (m["content"] or "") + (CALL_TEXT if m.get("tool_calls") else "")
        pieces += [(text, trained and (loss_on == "assistant" or i == last))
                   for text, trained in write(m["role"], content, eos)]
    ids, mask = [], []
    for text, trained in pieces:
        piece = packer.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(trained or loss_on == "all")] * len(piece)
    return ids, mask


@pytest.mark.parametrize("loss_on", ["assistant", "last_assistant", "all"])
@pytest.mark.parametrize("model", sorted(TEMPLATES))
def test_assistant_masks_are_the_templates_assistant_tokens(model, loss_on):
    """Every built-in text model's template: the trained tokens are exactly the assistant
    messages' content and eos (tool calls in the Hermes syntax), never the template's own."""
    packer = _packer(model)
    messages = TEMPLATES[model][2]
    x = packer.get_conversation_input(messages, loss_on)
    ids, mask = expected(model, packer, messages, loss_on)
    assert list(x.input_ids) == ids
    assert list(x.loss_mask) == mask
    assert x.n_prompt_tokens == (0 if loss_on == "all" else mask.index(1))


class ThinkStripping(DecoderOnlyLLMDataPacker):
    """A template that rewrites earlier assistant turns (as reasoning templates drop earlier
    thinking): not append-only."""

    def render_messages(self, messages, tools=None, add_generation_prompt=False):
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        kept = [dict(m, content="") if m["role"] == "assistant" and i < last else m
                for i, m in enumerate(messages)]
        return super().render_messages(kept, tools, add_generation_prompt)


def test_a_template_that_is_not_append_only_is_refused_in_one_line():
    packer = ThinkStripping()
    packer.setup(str(resolve_model_path("builtin:tiny-arith")))
    item = ObsBundle(CHAT, id="chat-7")
    with pytest.raises(RecipeError) as info:
        encode(packer, item, "assistant", "tiny-arith")
    text = str(info.value)
    assert "\n" not in text.strip()
    assert "not append-only" in text and "'chat-7'" in text and "message 4" in text


@pytest.fixture(scope="module")
def model64():
    path = resolve_model_path("builtin:tiny-arith")
    return load_causal_lm(path, dtype="float64"), build_packer(path, "qwen2")


def by_hand(model, inputs) -> float:
    """The mean NLL of the trained tokens, one sequence and one token at a time."""
    total, count = 0.0, 0
    for x in inputs:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([x.input_ids])).logits[0]
        for t in range(1, len(x.input_ids)):
            if x.loss_mask[t]:
                row = logits[t - 1]
                total -= float(row[x.input_ids[t]] - torch.logsumexp(row, 0))
                count += 1
    return total / count


def test_loss_by_hand_on_two_conversations(model64):
    """The loop's loss (padded batch, shifted grid, masked mean) equals the NLL summed token by
    token over both conversations and divided by their trained tokens; two micro-batches, each
    weighted by its share of the tokens, give the same loss."""
    model, packer = model64
    single = [{"role": "user", "content": "12-5="}, {"role": "assistant", "content": "7"}]
    inputs = [packer.get_conversation_input(c) for c in (CHAT, single)]
    lp, mask = batch_logprobs(model, packer.collate(inputs))
    loss, metrics = sft_loss(lp, mask)
    assert abs(loss.item() - by_hand(model, inputs)) < 1e-12
    assert metrics["loss"].item() == loss.item()
    tokens = [sum(x.loss_mask[1:]) for x in inputs]
    pieces = [sft_loss(*batch_logprobs(model, packer.collate([x])))[0].item() * n / sum(tokens)
              for x, n in zip(inputs, tokens, strict=True)]
    assert abs(sum(pieces) - loss.item()) < 1e-12


def test_packed_equals_unpacked(model64):
    """Conversations of different lengths packed end to end (per-sequence positions, no
    attention across them) give the padded batch's loss."""
    model, packer = model64
    chats = [CHAT, CHAT[:3], [{"role": "user", "content": "1+1="},
                              {"role": "assistant", "content": "2"}]]
    batch = packer.collate([packer.get_conversation_input(c) for c in chats])
    assert packed_logprobs(model, batch, 1.0) is not None  # the packed layout runs
    padded = sft_loss(*batch_logprobs(model, batch, pad_free=False))[0]
    packed = sft_loss(*batch_logprobs(model, batch, pad_free=True))[0]
    assert abs(packed.item() - padded.item()) < 1e-12


def _jsonl(path, rows_):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return path


def _sources(path, *overrides):
    recipe = load_recipe(REPO / "recipes" / "sft-arith.toml",
                         [f"data.path={path}", "data.validation.enabled=false", *overrides])
    return build_prompt_sources(recipe.data, recipe.algo.kind)


def test_malformed_messages_and_missing_column_name_the_row_and_field(tmp_path):
    bad = [dict(m) for m in CHAT]
    del bad[1]["role"]
    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}, {"messages": bad}])
    with pytest.raises(RecipeError) as info:
        _sources(path, "data.messages_column=messages")
    text = str(info.value)
    assert "\n" not in text.strip()
    assert f"row 1 of {path}" in text and "messages[1].role" in text
    with pytest.raises(RecipeError) as info:
        _sources(path, "data.messages_column=conversation")
    text = str(info.value)
    assert "'conversation' is not in row 0" in text and "data.messages_column" in text


def test_a_source_without_answers_is_refused_with_the_recipe(tmp_path):
    with pytest.raises(RecipeError, match="data.messages_column: SFT trains on answers"):
        load_recipe(REPO / "recipes" / "sft-arith.toml", [f"data.path={tmp_path}/x.jsonl"])
    with pytest.raises(RecipeError, match="built-in arithmetic data has fixed"):
        load_recipe(REPO / "recipes" / "sft-arith.toml", ["data.messages_column=messages"])


def test_a_conversation_without_an_answer_is_named(tmp_path):
    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT[:2]}])
    with pytest.raises(RecipeError, match="row 0 .* has no assistant message"):
        _sources(path, "data.messages_column=messages")


SMALL = ("algo.examples_per_step=4", "data.validation.size=8", "train.eval_every=2",
         "logging.sample_every=0")


def test_cli_run_on_tool_conversations(run_cli, tmp_path):
    """Two steps end to end on a file of tool-using conversations, with held-out ones."""
    train = _jsonl(tmp_path / "train.jsonl", [{"messages": TOOLS_CHAT}] * 6)
    held = [dict(m) for m in TOOLS_CHAT]
    held[1] = {"role": "user", "content": "2+5="}
    val = _jsonl(tmp_path / "val.jsonl", [{"messages": held}])
    rc, out, err = run_cli("--plain", "recipes/sft-arith.toml", f"run.output_dir={tmp_path / 'r'}",
                           "model.path=builtin:tiny-arith-tools", f"data.path={train}",
                           "data.messages_column=messages", f"data.validation.path={val}",
                           "run.max_steps=2", "reward.functions=['exact_match']", *SMALL)
    assert rc == 0, out + err
    last = rows(tmp_path / "r")[-1]
    assert last["step"] == 2 and last["sft/examples"] == 4 and last["sft/tokens"] > 0
    assert math.isclose(last["eval/perplexity"], math.exp(last["eval/nll"]))
    assert "eval/reward" in last


def test_overlong_conversations_are_dropped_and_counted(run_cli, tmp_path):
    rc, out, err = run_cli("--plain", "recipes/sft-arith.toml", f"run.output_dir={tmp_path}",
                           "run.max_steps=1", "algo.max_seq_len=12", "algo.overlong=drop",
                           *SMALL)
    assert rc == 0, out + err
    assert rows(tmp_path)[-1]["sft/dropped"] + rows(tmp_path)[-1]["sft/examples"] == 4
    rc, out, err = run_cli("--plain", "recipes/sft-arith.toml", f"run.output_dir={tmp_path}/b",
                           "run.max_steps=1", "algo.max_seq_len=4", *SMALL)
    assert rc != 0 and "algo.max_seq_len" in out + err and "tokens, more than 4" in out + err


RESUME = ("algo.examples_per_step=4", "data.validation.size=8", "train.eval_every=2",
          "checkpoint.every_steps=1", "checkpoint.keep_last=3", "logging.sample_every=0")


def test_sigkill_resume_is_bitwise(tmp_path):
    """A straight run of 4 steps; another SIGKILLed once after a checkpoint, resumed to 4: the
    same metrics, weights, optimizer state and cursor."""
    recipe, straight, resumed = "recipes/sft-arith.toml", tmp_path / "a", tmp_path / "b"
    done = run_subprocess(recipe, straight, "run.max_steps=4", *RESUME)
    assert done.returncode == 0, done.stdout + done.stderr
    where = kill_at_random_points(recipe, resumed, 4, RESUME, random.Random(3), kills=1)
    done = run_subprocess(recipe, resumed, "run.max_steps=4", *RESUME)
    assert where, "no kill happened"
    assert done.returncode == 0 and "resuming" in done.stdout, done.stdout + done.stderr
    try:
        assert_same_run(resumed, straight, 4, ("model/model.safetensors",
                                               "optimizer.safetensors"))
    except AssertionError as exc:
        raise AssertionError(f"after kills at {where}: {exc}") from exc


# --- chaining: an SFT run folder as the next run's model ----------------------------------------

LATER = ("run.max_steps=1", "algo.prompts_per_step=4", "data.validation.enabled=false",
         "logging.sample_every=0")


def _resolved_models(out) -> dict:
    import tomllib

    return tomllib.loads((out / "recipe.resolved.toml").read_text())["resolved"].get("models", {})


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _farthest(a: dict, b: dict) -> float:
    """The largest difference of a weight both hold (a tied LM head is saved once)."""
    both = set(a) & set(b)
    assert len(both) > 10, (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in both)


def test_an_sft_run_folder_starts_grpo_and_teaches_opd(tmp_path):
    """``sft -> grpo`` and ``sft -> opd`` without copying a path: GRPO's ``model.path`` and
    OPD's ``algo.teacher_path`` name the SFT run's folder, which means its newest complete
    checkpoint's model, recorded in each run's resolved recipe. GRPO (at lr 1e-9) ends its
    first step where the SFT run ended, 1e-6 away, while two SFT steps moved the built-in model
    by far more; OPD's student (the built-in model) has a reverse KL to that teacher."""
    sft = tmp_path / "sft"
    done = run_subprocess("recipes/sft-arith.toml", sft, "run.max_steps=2",
                          "algo.examples_per_step=8", "data.validation.enabled=false",
                          "logging.sample_every=0")
    assert done.returncode == 0, done.stdout + done.stderr
    model = sft / "checkpoints" / "step-000002" / "model"
    grpo = tmp_path / "grpo"
    done = run_subprocess("recipes/grpo-arith.toml", grpo, f"model.path={sft}", "train.lr=1e-9",
                          "algo.group_size=4", *LATER)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _resolved_models(grpo) == {"model.path": str(model)}
    start = load_causal_lm(resolve_model_path("builtin:tiny-arith-restate")).state_dict()
    trained = _weights(model)
    assert _farthest(_weights(grpo / "checkpoints" / "step-000001" / "model"), trained) < 1e-6
    assert _farthest(trained, start) > 1e-4
    opd = tmp_path / "opd"
    done = run_subprocess("recipes/opd-arith.toml", opd, f"algo.teacher_path={sft}", *LATER)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _resolved_models(opd) == {"algo.teacher_path": str(model)}
    assert rows(opd)[-1]["reverse_kl"] > 0


# --- the seed's data seam, for conversations ------------------------------------------------------

HERE = __name__  # the factories below, by dotted path


def chat_rows(count: int = 3):
    """A factory of conversations (a map-style list of rows)."""
    return [{"turns": [{"role": "user", "content": f"{i}+1="},
                       {"role": "assistant", "content": str(i + 1)}]} for i in range(count)]


def turns_to_messages(row):
    """An items_fn: the row reshaped to the messages column the recipe names."""
    return {"messages": [*CHAT[:1], *row["turns"]]}


def test_a_factory_of_conversations_through_items_fn(tmp_path):
    """``data.factory`` and ``data.items_fn`` give SFT its conversations as they give GRPO its
    prompts: items_fn's rows are read through ``data.messages_column`` (and fingerprinted), and
    a factory that is not there is one line naming its dotted path."""
    from runner.data.conversations import conversation_of
    from runner.errors import ExtensionError

    recipe = load_recipe(REPO / "recipes" / "sft-arith.toml", [
        f"data.factory={HERE}.chat_rows", "data.factory_kwargs={count = 3}",
        f"data.items_fn={HERE}.turns_to_messages", "data.messages_column=messages",
        "data.validation.enabled=false"])
    train, _ = build_prompt_sources(recipe.data, "sft")
    assert len(train) == 3 and conversation_of(train.item(2)) == [
        CHAT[0], {"role": "user", "content": "2+1="}, {"role": "assistant", "content": "3"}]
    assert train.fingerprint_parts()["items_fn"] == f"{HERE}.turns_to_messages"
    missing = attrs.evolve(recipe.data, factory=f"{HERE}.no_such_factory")
    with pytest.raises(ExtensionError) as info:
        build_prompt_sources(missing, "sft")
    text = str(info.value).strip()
    assert "\n" not in text and text.startswith(f"data.factory: {HERE}.no_such_factory: ")


def test_prompt_and_response_columns_make_one_turn_each(tmp_path):
    from runner.data.conversations import conversation_of

    path = _jsonl(tmp_path / "pairs.jsonl", [{"q": "3+4=", "a": "7"}, {"q": "9-2=", "a": "7"}])
    train, _ = _sources(path, "data.prompt_column=q", "data.response_column=a")
    assert [conversation_of(train.item(i)) for i in range(2)] == [
        [{"role": "user", "content": q}, {"role": "assistant", "content": "7"}]
        for q in ("3+4=", "9-2=")]


def test_strict_resume_refuses_changed_conversations(tmp_path):
    """The cursor fingerprint covers an SFT source's conversations and its tools column: a
    cursor saved over one file is refused under ``data.cursor_resume = "strict"`` once the
    file holds other conversations, naming the key and the part that changed; the same file
    resumes."""
    from runner.data.cursor import DataCursor, check_resume
    from runner.errors import ResumeError

    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}] * 8)
    columns = ("data.messages_column=messages",)
    before = _sources(path, *columns)[0].fingerprint_parts()
    saved = DataCursor(0, 4, 0, _sources(path, *columns)[0].fingerprint())
    assert check_resume(saved, before, before, "strict", seed=0) == saved
    _jsonl(path, [{"messages": TOOLS_CHAT, "tools": []}] * 8)
    for now in (_sources(path, *columns)[0].fingerprint_parts(),
                _sources(path, *columns, "data.tools_column=tools")[0].fingerprint_parts()):
        with pytest.raises(ResumeError) as info:
            check_resume(saved, now, before, "strict", seed=0)
        assert str(info.value).startswith("data.cursor_resume: the saved data cursor does not "
                                          "match"), str(info.value)


def test_lora_sft_exports_evaluates_and_reports(tmp_path, run_cli):
    """SFT with LoRA adapters (only they are saved); ``export`` merges them into a folder
    transformers loads, whose weights moved from the base model's; ``eval`` of the newest
    checkpoint and ``report`` of the run read it like any other run's."""
    import json as _json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    done = run_subprocess("recipes/sft-arith.toml", out, "run.max_steps=2", "model.lora.rank=4",
                          "model.lora.alpha=8", "train.lr=3e-3", "data.validation.size=8",
                          "train.eval_every=2", *SMALL[:1], "logging.sample_every=0")
    assert done.returncode == 0, done.stdout + done.stderr
    saved = out / "checkpoints" / "step-000002" / "model"
    adapters = load_file(saved / "adapter_model.safetensors")
    assert adapters and all("lora_" in k for k in adapters)
    assert not (saved / "model.safetensors").exists()
    rc, stdout, err = run_cli("export", str(out), str(tmp_path / "merged"))
    assert rc == 0, stdout + err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    base = load_causal_lm(resolve_model_path("builtin:tiny-arith-restate")).state_dict()
    moved = max(float((merged[k] - base[k]).abs().max()) for k in base if "proj" in k)
    assert moved > 1e-4 and set(merged) == set(base)
    rc, stdout, err = run_cli("eval", "--plain", "recipes/sft-arith.toml", "--checkpoint",
                              "latest", f"run.output_dir={out}", "data.validation.size=8",
                              "model.lora.rank=4", "model.lora.alpha=8")
    assert rc == 0, stdout + err
    result = _json.loads((out / "eval" / "step-000002" / "eval.json").read_text())
    assert result["algo"] == "sft" and result["step"] == 2 and result["prompts"] == 8
    assert "reward" in result["metrics"]
    rc, stdout, err = run_cli("report", str(out), "--out", str(tmp_path / "report.html"))
    assert rc == 0, stdout + err
    page = (tmp_path / "report.html").read_text()
    assert "eval/nll" in page and "sft/tokens" in page


# --- tool schemas (data.tools_column) -------------------------------------------------------------

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "integer"}, "b": {"type": "integer"}},
                                            "required": ["a", "b"]}}}


def test_tool_schemas_render_with_the_conversation_untrained(tmp_path):
    """A row's ``tools`` column reaches the chat template as an agent's tools do: the whole
    conversation renders as the template renders it with them (tiny-arith-tools writes a
    ``tools: add(a, b)`` line first), that line is not trained, and the trained tokens are
    those of the same conversation without tools. The held-out prompt keeps them."""
    from runner.data.conversations import generation_item

    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": TOOLS_CHAT, "tools": [ADD]}])
    train, _ = _sources(path, "data.messages_column=messages", "data.tools_column=tools",
                        "model.path=builtin:tiny-arith-tools")
    item = train.item(0)
    assert item.tools == (ADD,)
    packer = _packer("builtin:tiny-arith-tools")
    x = encode(packer, item, "assistant", "tiny-arith-tools")
    bare = encode(packer, attrs.evolve(item, tools=()), "assistant", "tiny-arith-tools")
    assert list(x.input_ids) == packer.render_messages(TOOLS_CHAT, [ADD])
    header = len(x.input_ids) - len(bare.input_ids)
    assert header > 0 and "tools: add(a, b)" in packer.decode(x.input_ids[:header + 1],
                                                              skip_special_tokens=False)
    assert not any(x.loss_mask[:header + 1])
    trained = [t for t, m in zip(x.input_ids, x.loss_mask, strict=True) if m]
    assert trained == [t for t, m in zip(bare.input_ids, bare.loss_mask, strict=True) if m]
    prompt = generation_item(item)
    assert prompt.tools == (ADD,) and "tools: add(a, b)" in packer.get_rollout_input(prompt)


def test_tool_schemas_that_are_not_are_named_and_need_messages(tmp_path):
    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT, "tools": [{"function": {}}]}])
    with pytest.raises(RecipeError) as info:
        _sources(path, "data.messages_column=messages", "data.tools_column=tools").item(0)
    text = str(info.value).strip()
    assert "\n" not in text and f"row 0 of {path}" in text and "tools[0].function.name" in text
    with pytest.raises(RecipeError, match="data.tools_column: tool schemas go with whole "
                                          "conversations"):
        load_recipe(REPO / "recipes/sft-arith.toml", [f"data.path={path}",
                                                      "data.response_column=a",
                                                      "data.tools_column=tools"])


def test_cli_run_with_tool_schemas(run_cli, tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"messages": TOOLS_CHAT, "tools": [ADD]}] * 6)
    held = [dict(m) for m in TOOLS_CHAT]
    held[1] = {"role": "user", "content": "2+5="}
    val = _jsonl(tmp_path / "val.jsonl", [{"messages": held, "tools": [ADD]}] * 2)
    rc, out, err = run_cli("--plain", "recipes/sft-arith.toml", f"run.output_dir={tmp_path / 'r'}",
                           "model.path=builtin:tiny-arith-tools", f"data.path={train}",
                           "data.messages_column=messages", "data.tools_column=tools",
                           f"data.validation.path={val}", "data.validation.size=2",
                           "run.max_steps=1", *SMALL[:1], "logging.sample_every=0",
                           "train.eval_every=1")
    assert rc == 0, out + err
    last = rows(tmp_path / "r")[-1]
    assert last["sft/examples"] == 4 and math.isfinite(last["eval/nll"])


# --- conversations with images (data.image_column, a vision-language packer) ----------------------

PICTURE_CHAT = [{"role": "user", "content": "What colour is this?"},
                {"role": "assistant", "content": "red"},
                {"role": "user", "content": "Sure?"},
                {"role": "assistant", "content": "yes"}]


def _pictures(tmp_path, rows_):
    """Rows of ``PICTURE_CHAT`` whose ``image`` is a 32x32 picture of the given colour."""
    from PIL import Image

    out = []
    for k, (colour, answer) in enumerate(rows_):
        path = tmp_path / f"p{k}.png"
        Image.new("RGB", (32, 32), colour).save(path)
        chat = [dict(m) for m in PICTURE_CHAT]
        chat[1] = {"role": "assistant", "content": answer}
        out.append({"messages": chat, "image": str(path)})
    return out


def test_a_picture_conversation_trains_the_assistants_text_alone(tmp_path):
    """With ``data.image_column`` the row's image opens the first user message; the
    Qwen3-VL packer renders the conversation prefix by prefix on the template's unexpanded ids,
    then the processor expands the image into its vision tokens: the ids are the processor's
    for the whole conversation, no vision token is trained, the trained tokens are the
    assistant's replies and eos, and the pixel values and ``mm_token_type_ids`` come along."""
    from runner.data.conversations import conversation_of
    from runner.data.media import decode_media

    path = _jsonl(tmp_path / "chats.jsonl", _pictures(tmp_path, [((255, 0, 0), "red")]))
    train, _ = _sources(path, "data.messages_column=messages", "data.image_column=image",
                        "model.path=builtin:tiny-qwen3-vl")
    item = train.item(0)
    messages = conversation_of(item)
    assert messages[0]["content"] == [{"type": "image"},
                                      {"type": "text", "text": "What colour is this?"}]
    packer = build_packer(resolve_model_path("builtin:tiny-qwen3-vl"), "qwen3_vl")
    x = encode(packer, item, "assistant", "tiny-qwen3-vl")
    images = list(decode_media(item)[0])
    text = packer.processor.apply_chat_template(messages, tokenize=False)
    whole = packer.processor(text=[text], images=images, return_tensors="pt")
    assert list(x.input_ids) == whole["input_ids"][0].tolist()
    vision = whole["mm_token_type_ids"][0].tolist()
    assert sum(vision) > 1 and x.token_extra["mm_token_type_ids"] == tuple(vision)
    assert not any(m for m, v in zip(x.loss_mask, vision, strict=True) if v)
    trained = [t for t, m in zip(x.input_ids, x.loss_mask, strict=True) if m]
    assert packer.decode(trained, skip_special_tokens=False) == "red<|eos|>yes<|eos|>"
    assert torch.equal(x.extra["image_grid_thw"], whole["image_grid_thw"])


def test_pictures_that_do_not_fit_are_named(tmp_path):
    from runner.data.conversations import conversation_of

    rows_ = _pictures(tmp_path, [((0, 0, 255), "blue")])
    rows_[0]["messages"][0]["content"] = [{"type": "image"}, {"type": "image"},
                                          {"type": "text", "text": "Which?"}]
    path = _jsonl(tmp_path / "chats.jsonl", rows_)
    train, _ = _sources(path, "data.messages_column=messages", "data.image_column=image")
    with pytest.raises(RecipeError, match=r"row 0 of .*: its messages hold 2 image part\(s\) but "
                                          r"the row has 1 image\(s\)"):
        conversation_of(train.item(0))
    text_only = _pictures(tmp_path, [((0, 0, 255), "blue")])
    path = _jsonl(tmp_path / "text.jsonl", text_only)
    train, _ = _sources(path, "data.messages_column=messages", "data.image_column=image")
    with pytest.raises(RecipeError, match="data.image_column: DecoderOnlyLLMDataPacker renders "
                                          "text only"):
        encode(_packer("builtin:tiny-arith"), train.item(0), "assistant", "tiny-arith")


def test_one_question_about_two_pictures_is_two_items(tmp_path):
    """A file source's membership ids hash the raw image references with the prompt, so a
    held-out set that asks the training set's question about other pictures does not
    overlap it."""
    rows_ = _pictures(tmp_path, [((255, 0, 0), "red"), ((0, 255, 0), "green")])
    path = _jsonl(tmp_path / "chats.jsonl", rows_)
    train, _ = _sources(path, "data.messages_column=messages", "data.image_column=image")
    ids = train.membership_ids()
    assert len(set(ids)) == 2
    from runner.data.membership import item_id

    assert list(ids) == [item_id(train.item(i)) for i in range(2)]


def test_cli_sft_of_a_vision_language_model_on_pictures(run_cli, tmp_path):
    """Two steps of SFT on ``builtin:tiny-qwen3-vl`` from a file of picture conversations,
    with held-out ones: the loss, the held-out NLL and the greedy replies' reward."""
    colours = [((255, 0, 0), "red"), ((0, 255, 0), "green"), ((0, 0, 255), "blue")]
    (tmp_path / "t").mkdir()
    (tmp_path / "v").mkdir()
    train = _jsonl(tmp_path / "train.jsonl", _pictures(tmp_path / "t", colours * 2))
    val = _jsonl(tmp_path / "val.jsonl", _pictures(tmp_path / "v", colours))
    rc, out, err = run_cli("--plain", "recipes/sft-arith.toml", f"run.output_dir={tmp_path / 'r'}",
                           "model.path=builtin:tiny-qwen3-vl", f"data.path={train}",
                           "data.messages_column=messages", "data.image_column=image",
                           f"data.validation.path={val}", "data.validation.size=3",
                           "run.max_steps=2", *SMALL[:1], "train.eval_every=2",
                           "logging.sample_every=0", "reward.functions=['exact_match']")
    assert rc == 0, out + err
    last = rows(tmp_path / "r")[-1]
    assert last["sft/examples"] == 4 and math.isfinite(last["loss"])
    assert math.isfinite(last["eval/nll"]) and 0 <= last["eval/reward"] <= 1
