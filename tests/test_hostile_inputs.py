"""Inputs a hostile file or a careless user gives: each is refused with one line that names the
file and row (or the dotted path), never trained on, never a traceback or a hang.

The cases are tables: a later round adds rows. Most call the reader or validator directly; the
few that need a run use one step of tiny data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.data.files import load_local
from runner.data.preference import build_pair_source
from runner.data.sources import build_prompt_sources
from runner.errors import RecipeError
from runner.recipe.schema import DataConfig, ValidationConfig

OFF = ValidationConfig(enabled=False)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _one_line(exc: RecipeError, path: Path) -> str:
    lines = exc.lines()
    assert len(lines) == 1, lines
    return lines[0].replace(str(path), "P")


# --- data.path (GRPO, PPO, OPD): rows through datasets -----------------------------------------

def _jsonl(*rows: object) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


GOOD = {"prompt": "1 + 1 =", "answer": "2"}
FIX = " Fix or drop the row, or reshape rows with data.items_fn."

PATH_CASES = {
    # a key missing from a later row: datasets fills it with null (row 0 is fine)
    "missing prompt in row 2": (
        "p.jsonl", _jsonl(GOOD, GOOD, {"answer": "3"}),
        "data.prompt_column: row 2 of P: column 'prompt' is null or missing." + FIX),
    "null prompt": (
        "p.jsonl", _jsonl(GOOD, {"prompt": None, "answer": "3"}),
        "data.prompt_column: row 1 of P: column 'prompt' is null or missing." + FIX),
    "dict prompt": (
        "p.jsonl", _jsonl({"prompt": {"text": "hi"}, "answer": "3"}),
        "data.prompt_column: row 0 of P: column 'prompt' is a mapping, not text or a list of "
        "chat messages." + FIX),
    "list prompt of strings": (
        "p.jsonl", _jsonl({"prompt": ["a", "b"], "answer": "3"}),
        "data.prompt_column: row 0 of P: column 'prompt' is a list whose element 0 is not a chat "
        "message (a mapping with a text 'role' and a 'content')." + FIX),
    "null answer": (
        "p.jsonl", _jsonl(GOOD, GOOD, GOOD, {"prompt": "x", "answer": None}),
        "data.response_column: row 3 of P: column 'answer' is null or missing (the reward would "
        "compare against nothing)." + FIX),
    "csv cut inside a quoted field": (
        "p.csv", b'prompt,answer\n1 + 1 =,2\n2 + 2 =,"4',
        "data.path: P line 3: not valid CSV (unexpected end of data). Close every quoted field."),
    "csv cut inside the last row": (
        "p.csv", b"prompt,answer\n1 + 1 =,2\n2 + 2 =,1",
        "data.path: P line 3: the last row does not end with a line break, so the file may be "
        "cut inside it. End the file with a line break if it is complete."),
    "ragged csv: more fields than the header": (
        "p.csv", b"prompt,answer\n1 + 1 =,2,extra,more\n2 + 2 =,4\n",
        "data.path: P line 2: the row has 4 fields where the header has 2. Give every row one "
        "field per header column (quote fields that hold commas)."),
    "ragged csv: fewer fields": (
        "p.csv", b"prompt,answer\n1 + 1 =,2\n2 + 2 =\n",
        "data.path: P line 3: the row has 1 fields where the header has 2. Give every row one "
        "field per header column (quote fields that hold commas)."),
    "jsonl with a key twice": (
        "p.jsonl", b'{"prompt": "a", "prompt": "b", "answer": "1"}\n',
        None),  # datasets refuses it (its own words)
}


@pytest.mark.parametrize("name", sorted(PATH_CASES))
def test_data_path_refuses(tmp_path, home, name):
    filename, content, expected = PATH_CASES[name]
    path = tmp_path / filename
    path.write_bytes(content)
    data = DataConfig(path=str(path), prompt_column="prompt", response_column="answer",
                      validation=OFF)
    with pytest.raises(RecipeError) as info:
        build_prompt_sources(data, "grpo")
    line = _one_line(info.value, path)
    if expected is None:
        assert line.startswith("data.path: ") and "twice" in line, line
    else:
        assert line == expected


@pytest.mark.parametrize("filename,content", [
    ("p.csv", b"\xef\xbb\xbfprompt,answer\n1 + 1 =,2\n"),
    ("p.jsonl", b"\xef\xbb\xbf" + _jsonl(GOOD)),
])
def test_data_path_reads_a_bom_as_nothing(tmp_path, home, filename, content):
    path = tmp_path / filename
    path.write_bytes(content)
    ds, _ = load_local(str(path), "train", key="data.path", split_key="data.split")
    assert ds.column_names == ["prompt", "answer"]
    assert [row["prompt"] for row in ds] == ["1 + 1 ="]


def test_chat_message_prompts_are_accepted(tmp_path, home):
    path = tmp_path / "p.jsonl"
    path.write_bytes(_jsonl({"prompt": [{"role": "user", "content": "1 + 1 ="}], "answer": "2"}))
    data = DataConfig(path=str(path), prompt_column="prompt", response_column="answer",
                      validation=OFF)
    train, _ = build_prompt_sources(data, "grpo")
    assert train.item(0).prompt == [{"role": "user", "content": "1 + 1 ="}]


# --- DPO jsonl ----------------------------------------------------------------------------------

PAIR = {"prompt": "p", "chosen": "good", "rejected": "bad"}

PAIR_CASES = {
    "a key twice": (
        b'{"prompt": "p", "chosen": "good", "chosen": "bad", "rejected": "bad"}\n',
        "data.jsonl_path: P line 1: the key 'chosen' appears twice. Give each key once per line."),
    "dict prompt": (
        _jsonl(PAIR, {**PAIR, "prompt": {"text": "p"}}),
        "data.jsonl_path: P line 2: the prompt is a mapping, not text (got {'text': 'p'}). Write "
        "the prompt as a JSON string."),
    "null prompt": (
        _jsonl({**PAIR, "prompt": None}),
        "data.jsonl_path: P line 1: the prompt is null, not text (got None). Write the prompt as "
        "a JSON string."),
}


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_dpo_jsonl_refuses(tmp_path, name):
    content, expected = PAIR_CASES[name]
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(RecipeError) as info:
        build_pair_source(DataConfig(jsonl_path=str(path), validation=OFF))
    assert _one_line(info.value, path) == expected


def test_dpo_jsonl_reads_a_bom_as_nothing(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _jsonl(PAIR, PAIR))
    source = build_pair_source(DataConfig(jsonl_path=str(path), validation=OFF))
    assert len(source) == 2 and source.pair(0).prompt == "p"
