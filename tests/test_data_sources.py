"""Prompt sources: built-in, local files, hub (offline), factories, columns and fingerprints."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from runner.data.sources import build_prompt_source, build_prompt_sources, check_columns
from runner.errors import ExtensionError, RecipeError
from runner.recipe.schema import DataConfig, ValidationConfig
from runner.types import ObsBundle

ROOT = Path(__file__).resolve().parents[1]
HERE = __name__  # dotted prefix of the factories below
EX = "examples.posttrain_extensions"


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


# Factories used through dotted paths.
def rows(count: int = 3):
    return [{"q": f"question {i}", "a": i, "img": f"i{i}.png", "uid": f"u{i}", "lang": "en",
             "secret": "x"} for i in range(count)]


class Indexed:
    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        return {"q": f"question {i}", "a": i}

    def cursor_fingerprint(self):
        return f"indexed-{self.count}"

    def membership_ids(self):
        return tuple(f"id{i}" for i in range(self.count))


def indexed(count: int = 3):
    return Indexed(count)


def iterable_only():
    return (row for row in rows())


def empty():
    return []


def not_a_dataset():
    return 42


def raising():
    raise RuntimeError("no data here")


def tuples():
    return [("a", "b")]


class Unreadable(Indexed):
    def __getitem__(self, i):
        raise AssertionError("an item was read")


def unreadable(count: int = 5, offset: int = 0):
    obj = Unreadable(count)
    obj.membership_ids = lambda: tuple(f"id{i + offset}" for i in range(count))
    return obj


def no_membership():
    return rows()


def lowercase(row):
    return {**row, "q": row["q"].upper()}


def returns_list(row):
    return [row]


def data(**kw) -> DataConfig:
    kw.setdefault("validation", ValidationConfig(enabled=False))
    return DataConfig(**kw)


# --- built-in arithmetic ---------------------------------------------------------------------

def test_builtin_train_and_held_out_are_disjoint_and_pure():
    d = DataConfig(count=50, validation=ValidationConfig(size=20), max_operand=9)
    train, held = build_prompt_sources(d, "grpo")
    assert (len(train), len(held)) == (50, 20)
    assert not set(train.membership_ids()) & set(held.membership_ids())
    item = train.item(0)
    a, op, b = item.prompt.removeprefix("What is ").removesuffix("?").split()
    assert item.reference == str(eval(f"{a}{op}{b}"))
    again = build_prompt_source(d, "grpo")
    assert [again.item(i) for i in range(50)] == [train.item(i) for i in range(50)]
    assert again.fingerprint() == train.fingerprint()
    assert build_prompt_source(attrs.evolve(d, operators=["*"]), "grpo").fingerprint() != \
        train.fingerprint()


def mutate(row):
    row["prompt"] += "!"
    return row


def test_builtin_rows_take_ppo_columns_and_survive_a_mutating_items_fn():
    src = build_prompt_source(data(id_column="key", items_fn=f"{HERE}.mutate"), "ppo")
    first, again = src.item(0), src.item(0)
    assert first == again and first.prompt.endswith("?!") and not first.prompt.endswith("!!")
    a, op, b = first.prompt.removeprefix("What is ").removesuffix("?!").split()
    assert first.id == f"{a}{op}{b}"


def test_builtin_bad_operator_is_a_recipe_error():
    with pytest.raises(RecipeError, match="data.operators: unknown operator '/'"):
        build_prompt_source(data(operators=["/"]), "grpo")


# --- local files -----------------------------------------------------------------------------

def write_jsonl(path: Path, items) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


def test_jsonl_file_with_renamed_columns(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", rows(4))
    src = build_prompt_source(data(path=str(f), prompt_column="q", response_column="a"), "opd")
    assert len(src) == 4
    assert src.item(2) == ObsBundle(prompt="question 2", reference="2")
    assert src.raw(2)["secret"] == "x"
    assert src.describe() == {"kind": "path", "size": "4", "identity": str(f)}


@pytest.mark.parametrize("fmt", ["csv", "parquet", "json"])
def test_other_file_formats(tmp_path, fmt):
    import datasets

    ds = datasets.Dataset.from_list([{"q": "x", "a": "1"}, {"q": "y", "a": "2"}])
    f = tmp_path / f"p.{fmt}"
    getattr(ds, f"to_{fmt}")(str(f))
    src = build_prompt_source(data(path=str(f), prompt_column="q", response_column="a"), "grpo")
    assert [src.item(i).prompt for i in range(2)] == ["x", "y"]


def test_folder_with_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", rows(3))
    write_jsonl(tmp_path / "test.jsonl", rows(1))
    (tmp_path / "README.md").write_text("ignored")
    d = data(path=str(tmp_path), prompt_column="q", split="test")
    assert len(build_prompt_source(d, "grpo")) == 1
    with pytest.raises(RecipeError, match="data.split: .*Unknown split"):
        build_prompt_source(attrs.evolve(d, split="dev"), "grpo")


def test_which_keys_combine_is_checked_once_with_the_recipe():
    """The data layer takes a checked [data] table: the rules live in runner.recipe.checks."""
    from runner.recipe import recipe_from_mapping

    with pytest.raises(RecipeError, match="data.path: data.factory and data.path are mutually "
                       "exclusive"):
        recipe_from_mapping({"data": {"factory": f"{HERE}.rows", "path": "x.jsonl"}})
    with pytest.raises(RecipeError, match="data.id_column: only used by PPO"):
        recipe_from_mapping({"data": {"id_column": "uid"}})
    with pytest.raises(RecipeError, match="data.validation.jsonl_path: only used by DPO"):
        recipe_from_mapping({"data": {"validation": {"jsonl_path": "h.jsonl"}}})
    src = ("runner/data/sources.py", "runner/data/columns.py", "runner/data/preference.py")
    for name in src:
        text = (ROOT / name).read_text()
        assert "mutually exclusive" not in text and "only used by" not in text, name


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(RecipeError, match="data.path: no such file or folder"):
        build_prompt_source(data(path=str(tmp_path / "nope.jsonl")), "grpo")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(RecipeError, match="data.path: unsupported file type '.txt'"):
        build_prompt_source(data(path=str(tmp_path / "x.txt")), "grpo")


def test_missing_column_names_it_and_lists_the_columns(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"question": "x", "answer": "1"}])
    src = build_prompt_source(data(path=str(f), response_column="answer"), "grpo")
    with pytest.raises(RecipeError) as info:
        check_columns(src)
    assert str(info.value) == (
        f"data.prompt_column: column 'prompt' is not in row 0 of {f} (its columns: 'question', "
        "'answer'). Set data.prompt_column to one of its columns, or reshape rows with "
        "data.items_fn.")


def test_validation_path_is_capped_at_size(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", rows(3))
    held = write_jsonl(tmp_path / "h.jsonl", [{"q": f"held {i}", "a": i} for i in range(9)])
    d = DataConfig(path=str(train), prompt_column="q",
                   validation=ValidationConfig(path=str(held), size=4))
    _, held_src = build_prompt_sources(d, "grpo")
    assert len(held_src) == 4


def test_file_overlap_is_refused(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", rows(3))
    held = write_jsonl(tmp_path / "h.jsonl", rows(2))
    d = DataConfig(path=str(train), prompt_column="q", validation=ValidationConfig(path=str(held)))
    with pytest.raises(RecipeError, match=r"data.validation: 2 held-out item id\(s\) of .*h.jsonl "
                       r"also appear in the training set .*t.jsonl: 'sha256:"):
        build_prompt_sources(d, "grpo")


@pytest.mark.parametrize("train_key, value", [("factory", f"{HERE}.indexed"), ("path", "FILE")])
def test_custom_train_source_without_held_out_source_trains_without_evaluation(
        tmp_path, train_key, value):
    from runner.recipe.held_out import held_out_reason

    if value == "FILE":
        value = str(write_jsonl(tmp_path / "t.jsonl", rows(3)))
    d = DataConfig(prompt_column="q", **{train_key: value})
    train, held = build_prompt_sources(d, "grpo")
    assert len(train) == 3 and held is None
    assert held_out_reason(d, "prompts") == (
        f"none: no held-out set is given for the data.{train_key} training source, so the run "
        "trains without held-out evaluation; set data.validation.factory or "
        "data.validation.path to evaluate")
    assert held_out_reason(attrs.evolve(d, validation=ValidationConfig(enabled=False)), "prompts") \
        == "off: data.validation.enabled is false"
    assert held_out_reason(DataConfig(), "prompts") == ""  # built-in prompts: built-in held-out set
    assert held_out_reason(attrs.evolve(d, validation=ValidationConfig(factory=f"{HERE}.indexed")),
                           "prompts") == ""


# --- hub names, offline ----------------------------------------------------------------------

@pytest.fixture
def alarm():
    """A guard against hanging forever (not a speed limit: what 'fast' means is asserted below
    by what is called, not by the clock)."""
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("hub lookup hung"))
    signal.alarm(600)
    yield
    signal.alarm(0)


def test_hub_name_fails_fast_when_the_hub_cannot_be_reached(monkeypatch, alarm):
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    # Failing fast means: one probe, then datasets asked once, from the cache only (no retries
    # against the hub). Record the offline switch each load_dataset call sees.
    seen = []
    real_load = datasets.load_dataset

    def load_dataset(*args, **kwargs):
        seen.append((datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(RecipeError) as info:
        build_prompt_source(data(name="someone/not-cached", config="main"), "grpo")
    assert seen == [(True, True)]
    text = str(info.value)
    assert text.startswith("data.name: cannot load hub dataset someone/not-cached (config 'main'): "
                           "the hub cannot be reached (127.0.0.1:9: ")
    assert "not in the local cache" in text
    assert datasets.config.HF_HUB_OFFLINE is False  # the offline switch was put back


def test_hub_name_with_offline_mode_set(monkeypatch, alarm):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(RecipeError, match="someone/not-cached: it is not in the local datasets "
                       r"cache and offline mode is set \(HF_HUB_OFFLINE\)"):
        build_prompt_source(data(name="someone/not-cached"), "grpo")


def test_hub_endpoint_from_the_environment_is_probed_first():
    """A fresh process with the hub endpoint set (to a loopback port nothing listens on) gives
    up on the hub and says so; nothing leaves the machine."""
    import os

    code = ("from runner.data.sources import build_prompt_source\n"
            "from runner.recipe.schema import DataConfig\n"
            "try:\n build_prompt_source(DataConfig(name='runner-tests/no-such-dataset'), 'grpo')\n"
            "except Exception as e:\n print(type(e).__name__, e)\n")
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("https_proxy", "http_proxy")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="0", HF_DATASETS_OFFLINE="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert out.stdout.startswith("RecipeError data.name: cannot load hub dataset "
                                 "runner-tests/no-such-dataset: the hub cannot be reached "
                                 "(127.0.0.1:9: "), out.stdout + out.stderr


# --- factories -------------------------------------------------------------------------------

def test_factory_rows_with_items_fn():
    src = build_prompt_source(data(factory=f"{HERE}.rows", factory_kwargs={"count": 2},
                                   prompt_column="q", response_column="a",
                                   items_fn=f"{HERE}.lowercase"), "grpo")
    assert src.item(1) == ObsBundle(prompt="QUESTION 1", reference="1")
    assert src.raw(1)["q"] == "question 1"
    assert src.fingerprint_parts()["items_fn"] == f"{HERE}.lowercase"


def test_items_fn_must_return_a_mapping():
    src = build_prompt_source(data(factory=f"{HERE}.rows", prompt_column="q",
                                   items_fn=f"{HERE}.returns_list"), "grpo")
    with pytest.raises(ExtensionError, match=rf"data.items_fn: {HERE}.returns_list: returned a "
                       "list for row 0, not a mapping"):
        src.item(0)


def test_ppo_allowlist_keeps_only_listed_fields():
    d = data(factory=f"{HERE}.rows", prompt_column="q", response_column="a", image_column="img",
             id_column="uid", metadata_columns=["lang"])
    with pytest.raises(ExtensionError, match="cursor_fingerprint"):
        build_prompt_source(d, "ppo")  # a plain list has no cursor_fingerprint()
    src = build_prompt_source(attrs.evolve(d, factory=f"{HERE}.indexed_ppo"), "ppo")
    item = src.item(1)
    assert item == ObsBundle(prompt="question 1", reference="1", images=("i1.png",), id="u1",
                             metadata={"lang": "en"})
    assert "secret" not in item.metadata


class RowsWithFingerprint(list):
    def cursor_fingerprint(self):
        return "rows-v1"


def indexed_ppo():
    return RowsWithFingerprint(rows())


@pytest.mark.parametrize("name,message", [
    ("iterable_only", "returned an iterable-only generator (it has no __len__ and __getitem__); "
                      "stable indexing is needed for rank sharding and exact resume"),
    ("empty", "returned an empty list"),
    ("not_a_dataset", "returned an object of type int, not a map-style dataset with __len__ "
                      "and __getitem__ over positions 0..n-1"),
    ("raising", "raised RuntimeError when called: no data here"),
    ("missing_function", f"'{HERE}' has no attribute 'missing_function'"),
])
def test_factory_contract_errors_name_the_dotted_path(name, message):
    with pytest.raises(ExtensionError) as info:
        build_prompt_source(data(factory=f"{HERE}.{name}"), "grpo")
    assert str(info.value).startswith(f"data.factory: {HERE}.{name}: {message}")


def test_rows_must_be_mappings_and_getitem_errors_are_named():
    src = build_prompt_source(data(factory=f"{HERE}.tuples"), "grpo")
    with pytest.raises(ExtensionError, match=rf"data.factory: {HERE}.tuples: item 0 is a tuple, "
                       "not a mapping of column names to values"):
        src.item(0)
    src = build_prompt_source(data(factory=f"{HERE}.unreadable"), "grpo")
    with pytest.raises(ExtensionError, match=rf"{HERE}.unreadable: item 3 raised AssertionError"):
        src.item(3)


def test_prompt_factory_without_membership_ids_gets_ids_from_item_text():
    from runner.data.membership import text_id

    d = DataConfig(factory=f"{HERE}.no_membership", prompt_column="q",
                   validation=ValidationConfig(factory=f"{HERE}.indexed"))
    train, held = build_prompt_sources(d, "grpo")  # no overlap: "question i" vs ids "id{i}"
    assert train.membership_ids() == tuple(text_id(f"question {i}") for i in range(3))
    assert train.membership_from == "each item's canonical text"
    assert held.membership_from == "its membership_ids()"
    # The same prompts on both sides: the overlap is found from the text.
    same = attrs.evolve(d, validation=ValidationConfig(factory=f"{HERE}.no_membership"))
    with pytest.raises(RecipeError, match=r"data.validation: 3 held-out item id\(s\)"):
        build_prompt_sources(same, "grpo")


def media_rows(kind: str = "paths"):
    image = {"paths": lambda i: f"img/{i % 2}.png", "bytes": lambda i: bytes([i % 2]) * 4,
             "mappings": lambda i: {"bytes": bytes([i % 2]) * 4, "path": None}}[kind]
    return RowsWithFingerprint(
        {"q": "what is shown?", "a": "x", "img": image(i)} for i in range(4))


class Pixels:
    """A decoded image: nothing says where it came from."""


def decoded_media():
    return RowsWithFingerprint([{"q": "what is shown?", "a": "x", "img": Pixels()}])


@pytest.mark.parametrize("kind", ["paths", "bytes", "mappings"])
def test_ppo_media_items_get_ids_from_the_raw_media_reference(kind):
    from runner.data.membership import item_id

    d = DataConfig(factory=f"{HERE}.media_rows", factory_kwargs={"kind": kind},
                   prompt_column="q", image_column="img",
                   validation=ValidationConfig(enabled=False))
    ids = build_prompt_source(d, "ppo").membership_ids()
    # One question about two pictures: two distinct ids, repeated with the pictures.
    assert ids[0] == ids[2] and ids[1] == ids[3] and ids[0] != ids[1]
    digest = "sha256:" + hashlib.sha256(b"\0" * 4).hexdigest()
    ref = {"paths": "img/0.png", "bytes": digest, "mappings": digest}[kind]
    assert ids[0] == item_id(ObsBundle("what is shown?", images=(ref,)))


def test_decoded_media_without_membership_ids_is_a_recipe_error():
    d = DataConfig(factory=f"{HERE}.decoded_media", prompt_column="q", image_column="img",
                   validation=ValidationConfig(enabled=False))
    with pytest.raises(RecipeError) as info:
        build_prompt_source(d, "ppo").membership_ids()
    assert str(info.value).startswith(
        "data.validation: cannot make a membership id for a Pixels media item in row 0 of "
        f"{HERE}.decoded_media() without decoding it.")


def test_overlap_is_found_without_reading_any_item():
    d = DataConfig(factory=f"{HERE}.unreadable", factory_kwargs={"count": 5},
                   validation=ValidationConfig(factory=f"{HERE}.unreadable",
                                               factory_kwargs={"count": 4, "offset": 3}))
    from runner.data.membership import check_overlap

    train = build_prompt_source(d, "grpo")
    held = build_prompt_source(d, "grpo", validation=True)
    with pytest.raises(RecipeError) as info:
        check_overlap(train, held)  # Unreadable.__getitem__ would raise AssertionError
    assert str(info.value).startswith(
        f"data.validation: 2 held-out item id(s) of {HERE}.unreadable(count=4, offset=3) also "
        f"appear in the training set {HERE}.unreadable(count=5): 'id3', 'id4'.")
    check_overlap(train, build_prompt_source(attrs.evolve(d, validation=ValidationConfig(
        factory=f"{HERE}.unreadable", factory_kwargs={"count": 4, "offset": 5})), "grpo",
        validation=True))


def test_example_extension_module_end_to_end():
    d = DataConfig(factory=f"{EX}.build_prompt_dataset", factory_kwargs={"count": 50},
                   prompt_column="question", response_column="answer",
                   items_fn=f"{EX}.add_instruction",
                   validation=ValidationConfig(factory=f"{EX}.build_held_out_prompt_dataset"))
    train, held = build_prompt_sources(d, "ppo")
    assert train.item(3) == ObsBundle(prompt="Reply with a number only. What is 6 + 7?",
                                      reference="13")
    assert (len(train), len(held)) == (50, 20)


# --- fingerprints ----------------------------------------------------------------------------

def fp(d: DataConfig) -> str:
    return build_prompt_source(d, "grpo").fingerprint()


def test_fingerprint_is_stable_and_tracks_what_indexes_mean(tmp_path):
    base = data(factory=f"{HERE}.indexed", factory_kwargs={"count": 3}, prompt_column="q")
    assert fp(base) == fp(attrs.evolve(base))
    assert fp(base) == fp(attrs.evolve(base, cursor_resume="strict", count=7))  # unrelated keys
    for changed in (attrs.evolve(base, factory_kwargs={"count": 4}),            # kwargs + length
                    attrs.evolve(base, prompt_column="a"),                      # columns
                    attrs.evolve(base, response_column="a"),
                    attrs.evolve(base, items_fn=f"{HERE}.lowercase"),
                    attrs.evolve(base, shuffle=False)):
        assert fp(changed) != fp(base)
    parts = build_prompt_source(base, "grpo").fingerprint_parts()
    assert parts["cursor_fingerprint"] == "indexed-3" and parts["length"] == "3"


def test_file_fingerprint_tracks_content_and_length(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", rows(3))
    d = data(path=str(f), prompt_column="q")
    first = build_prompt_source(d, "grpo").fingerprint_parts()
    assert build_prompt_source(d, "grpo").fingerprint_parts() == first
    write_jsonl(f, [{**r, "q": r["q"] + "!"} for r in rows(3)])
    edited = build_prompt_source(d, "grpo").fingerprint_parts()
    assert edited["content_sha256"] != first["content_sha256"] and edited["length"] == "3"
    write_jsonl(f, rows(4))
    assert build_prompt_source(d, "grpo").fingerprint_parts()["length"] == "4"
