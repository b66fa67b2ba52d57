"""DPO preference data: every source, the tar rules, shapes, cursor, held-out traversal."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import attrs
import pytest

from runner.data.cursor import DataCursor
from runner.data.membership import check_overlap
from runner.data.preference import DatasetPreferenceEnv, PreferencePair, build_pair_source
from runner.errors import ExtensionError, RecipeError
from runner.recipe.schema import DataConfig, ValidationConfig

ROOT = Path(__file__).resolve().parents[1]
HERE = __name__
EX = "examples.posttrain_extensions"
OFF = ValidationConfig(enabled=False)


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


def triples(count: int = 4):
    return [(f"p{i}", {"text": f"good {i}"}, {"text": f"bad {i}"}) for i in range(count)]


def mismatched():
    return [("p0", "a", "b"), ("p1", "a", {"text": "b"})]


def not_triples():
    return [("p0", "a")]


class Guarded:
    """Items that must not be read; ids from metadata."""

    def __init__(self, count, offset=0):
        self.count, self.offset = count, offset

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        raise AssertionError("an item was read")

    def membership_ids(self):
        return tuple(f"pair-{i + self.offset}" for i in range(self.count))


def guarded(count: int = 4, offset: int = 0):
    return Guarded(count, offset)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def jsonl(path: Path, items) -> str:
    return write(path, "".join(json.dumps(x) + "\n" for x in items))


# --- sources ---------------------------------------------------------------------------------

def test_builtin_pairs_prefer_the_correct_answer():
    env = DatasetPreferenceEnv(DataConfig(count=30, validation=ValidationConfig(size=10)),
                               seed=0)
    assert len(env) == 30 and len(env.validation_pairs()) == 10
    for pair in env.next_batch(30) + env.validation_pairs():
        a, op, b = pair.prompt.removeprefix("What is ").removesuffix("?").split()
        assert pair.chosen == str(eval(f"{a}{op}{b}"))
        assert 1 <= abs(int(pair.rejected) - int(pair.chosen)) <= 3
    assert len(DatasetPreferenceEnv(DataConfig(synthetic_pairs=7, validation=OFF), seed=0)) == 7


def test_jsonl_accepts_chosen_rejected_and_winner_loser(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "x", "rejected": "y"},
                                         {"prompt": "b", "winner": "z", "loser": "w"}])
    write(tmp_path / "p.jsonl", Path(path).read_text() + "\n")  # blank lines are skipped
    src = build_pair_source(DataConfig(jsonl_path=path, validation=OFF))
    assert [src.pair(i) for i in range(len(src))] == [
        PreferencePair("a", "x", "y", "train-0"), PreferencePair("b", "z", "w", "train-1")]


def test_jsonl_with_configured_keys(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"q": "a", "good": "x", "bad": "y"}])
    d = DataConfig(jsonl_path=path, prompt_column="q", chosen_key="good", rejected_key="bad",
                   validation=OFF)
    assert build_pair_source(d).pair(0) == PreferencePair("a", "x", "y", "train-0")
    with pytest.raises(RecipeError, match=r"p.jsonl line 1: no 'chosen' or 'winner' key \(its "
                       r"keys: 'q', 'good', 'bad'\). Set data.chosen_key"):
        build_pair_source(attrs.evolve(d, chosen_key="", rejected_key=""))


def test_malformed_jsonl_line_is_named(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"prompt": "a", "chosen": "x", "rejected": "y"}\n\n'
                 '{"prompt": "b", "chosen": \n')
    with pytest.raises(RecipeError) as info:
        build_pair_source(DataConfig(jsonl_path=path, validation=OFF))
    assert str(info.value) == (f"data.jsonl_path: {path} line 3: not valid JSON (Expecting value "
                               "at column 27). Write one JSON object per line.")


def test_shape_mismatch_names_the_line_or_the_item(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": {"t": "x"}, "rejected": "y"}])
    with pytest.raises(RecipeError, match=r"data.jsonl_path: .*p.jsonl: line 1: chosen and "
                       "rejected differ in shape: chosen is a dict but rejected a str"):
        build_pair_source(DataConfig(jsonl_path=path, validation=OFF))
    src = build_pair_source(DataConfig(factory=f"{HERE}.mismatched", validation=OFF))
    src.pair(0)
    with pytest.raises(ExtensionError, match=rf"data.factory: {HERE}.mismatched\(\): item 1: "
                       "chosen and rejected differ in shape"):
        src.pair(1)


def test_mapping_payloads_need_the_same_keys(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": {"t": "x", "u": 1},
                                         "rejected": {"t": "y"}}])
    with pytest.raises(RecipeError, match=r"chosen has keys \['t', 'u'\] but rejected \['t'\]"):
        build_pair_source(DataConfig(jsonl_path=path, validation=OFF))


def test_factory_pairs_and_their_errors():
    src = build_pair_source(DataConfig(factory=f"{HERE}.triples", factory_kwargs={"count": 3},
                                       validation=OFF))
    assert src.pair(2) == PreferencePair("p2", {"text": "good 2"}, {"text": "bad 2"}, "train-2")
    with pytest.raises(ExtensionError, match=rf"data.factory: {HERE}.not_triples: item 0 is a "
                       r"tuple, not a \(prompt, winner, loser\) triple"):
        build_pair_source(DataConfig(factory=f"{HERE}.not_triples", validation=OFF)).pair(0)
    from runner.recipe import recipe_from_mapping

    # Which keys combine is a recipe rule, checked once with the recipe.
    with pytest.raises(RecipeError, match="data.factory: a DPO factory cannot be combined with "
                       "data.synthetic_pairs"):
        recipe_from_mapping({"algo": {"kind": "dpo"},
                             "data": {"factory": f"{HERE}.triples", "synthetic_pairs": 3}})


def test_factory_without_membership_ids_fails_at_setup_when_validating():
    d = DataConfig(factory=f"{HERE}.triples",
                   validation=ValidationConfig(factory=f"{HERE}.guarded"))
    with pytest.raises(ExtensionError, match=rf"data.factory: {HERE}.triples: the returned list "
                       r"has no membership_ids\(\) method"):
        DatasetPreferenceEnv(d, seed=0)


def test_overlap_is_refused_without_reading_items():
    d = DataConfig(factory=f"{HERE}.guarded", factory_kwargs={"count": 6},
                   validation=ValidationConfig(factory=f"{HERE}.guarded",
                                               factory_kwargs={"count": 3, "offset": 4}))
    with pytest.raises(RecipeError, match=r"data.validation: 2 held-out item id\(s\) of .* also "
                       "appear in the training set .*: 'pair-4', 'pair-5'"):
        DatasetPreferenceEnv(d, seed=0)  # Guarded.__getitem__ would raise AssertionError
    check_overlap(build_pair_source(d), build_pair_source(attrs.evolve(
        d, validation=ValidationConfig(factory=f"{HERE}.guarded",
                                       factory_kwargs={"count": 3, "offset": 6})),
        validation=True))


def test_custom_training_pairs_need_a_held_out_source(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "x", "rejected": "y"}])
    with pytest.raises(RecipeError, match="validation is on but no held-out set is given for "
                       "the data.jsonl_path training source"):
        DatasetPreferenceEnv(DataConfig(jsonl_path=path), seed=0)
    from runner.recipe import recipe_from_mapping

    with pytest.raises(RecipeError, match="data.validation.path: DPO reads held-out pairs"):
        recipe_from_mapping({"algo": {"kind": "dpo"}, "data": {"validation": {"path": path}}})


# --- tar archives ----------------------------------------------------------------------------

def add(archive: tarfile.TarFile, name: str, data: bytes = b"", **kw) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in kw.items():
        setattr(info, k, v)
    archive.addfile(info, io.BytesIO(data))


def sample(i: int) -> bytes:
    return json.dumps({"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"}).encode()


@pytest.mark.parametrize("mode,suffix", [("w", ".tar"), ("w:gz", ".tar.gz")])
def test_tar_samples_are_read_in_memory_in_name_order(tmp_path, mode, suffix):
    path = tmp_path / f"prefs{suffix}"
    with tarfile.open(path, mode) as archive:
        add(archive, "samples", type=tarfile.DIRTYPE)
        add(archive, "samples/b.json", sample(1))
        add(archive, "samples/a.json", sample(0))
        add(archive, "README.txt", b"not a sample")
    before = sorted(p.name for p in tmp_path.iterdir())
    src = build_pair_source(DataConfig(tar_path=str(path), validation=OFF))
    assert [src.pair(i).prompt for i in range(len(src))] == ["p0", "p1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing extracted


@pytest.mark.parametrize("name,kw,why", [
    ("../escape.json", {}, "has an absolute path or a '..' component"),
    ("ok/../../escape.json", {}, "has an absolute path or a '..' component"),
    ("/etc/evil.json", {}, "has an absolute path or a '..' component"),
    ("link.json", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"},
     "is a link or a device, not a regular file"),
])
def test_unsafe_tar_members_are_refused(tmp_path, name, kw, why):
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as archive:
        add(archive, "a.json", sample(0))
        add(archive, name, b"" if kw else sample(1), **kw)
    with pytest.raises(RecipeError) as info:
        build_pair_source(DataConfig(tar_path=str(path), validation=OFF))
    assert str(info.value).startswith(f"data.tar_path: {path} member {name!r} {why}; the "
                                      "archive is refused.")


def test_tar_member_with_bad_json_is_named(tmp_path):
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as archive:
        add(archive, "x.json", b"{nope")
    with pytest.raises(RecipeError, match=r"member 'x.json': not valid JSON"):
        build_pair_source(DataConfig(tar_path=str(path), validation=OFF))


# --- cursor, shards, held-out traversal ------------------------------------------------------

def example(count: int = 40, **kw) -> DataConfig:
    return DataConfig(factory=f"{EX}.build_preference_dataset", factory_kwargs={"count": count},
                      validation=ValidationConfig(
                          factory=f"{EX}.build_held_out_preference_dataset", size=9), **kw)


def test_resumed_env_continues_the_straight_one():
    straight = DatasetPreferenceEnv(example(), seed=3)
    straight.next_batch(7)
    straight.next_batch(7)
    cursor = DataCursor.from_json(straight.cursor.to_json())
    resumed = DatasetPreferenceEnv(example(), seed=3, cursor=cursor)
    for _ in range(5):
        assert resumed.next_batch(7) == straight.next_batch(7)
    assert resumed.cursor == straight.cursor


def test_ranks_split_batches_and_the_held_out_pass():
    envs = [DatasetPreferenceEnv(example(12), seed=0, rank=r, world=3) for r in range(3)]
    seen = [p.id for env in envs for _ in range(2) for p in env.next_batch(2)]
    assert sorted(seen) == sorted(f"train-{i}" for i in range(12))  # one epoch, no repeats
    held = [[p.id for p in env.validation_pairs()] for env in envs]
    assert held == [["held_out-0", "held_out-3", "held_out-6"],
                    ["held_out-1", "held_out-4", "held_out-7"],
                    ["held_out-2", "held_out-5", "held_out-8"]]  # capped at size=9, fixed order


def test_fingerprint_tracks_length_kwargs_and_shuffle(tmp_path):
    base = DatasetPreferenceEnv(example(), seed=0).fingerprint_parts()
    assert DatasetPreferenceEnv(example(), seed=5).fingerprint_parts() == base
    grown = DatasetPreferenceEnv(example(50), seed=0).fingerprint_parts()
    assert (base["length"], grown["length"]) == ("40", "50")
    assert grown["factory_kwargs"] != base["factory_kwargs"]
    assert DatasetPreferenceEnv(example(shuffle=False), seed=0).fingerprint() != \
        DatasetPreferenceEnv(example(), seed=0).fingerprint()
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "x", "rejected": "y"}])
    first = build_pair_source(DataConfig(jsonl_path=path, validation=OFF)).fingerprint()
    jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "x", "rejected": "z"}])
    assert build_pair_source(DataConfig(jsonl_path=path, validation=OFF)).fingerprint() != first


def test_example_files_load():
    d = DataConfig(jsonl_path=str(ROOT / "examples/data/prefs.jsonl"),
                   validation=ValidationConfig(
                       jsonl_path=str(ROOT / "examples/data/held_out_prefs.jsonl")))
    env = DatasetPreferenceEnv(d, seed=0)
    assert (len(env), len(env.validation_pairs())) == (5, 2)
