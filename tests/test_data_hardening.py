"""Data files that are damaged, truncated, empty, not UTF-8 or oversized: a named refusal, never
a traceback and never part of the data."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest

from runner.data.files import arrow_cache_dir, load_local
from runner.data.pairs import PairKeys, file_pairs
from runner.data.preference import build_pair_source
from runner.errors import RecipeError
from runner.recipe.schema import DataConfig, ValidationConfig

OFF = ValidationConfig(enabled=False)
N = 20


def _sample(i: int) -> bytes:
    return json.dumps({"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"}).encode()


def _tar_bytes(count: int = N, extra: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in [(f"s{i:02d}.json", _sample(i)) for i in range(count)] + list(
                (extra or {}).items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _pairs(path: Path, **kw) -> int | str:
    """The number of pairs read, or the refusal's message."""
    try:
        return len(file_pairs(str(path), PairKeys(), kind="tar", key="data.tar_path",
                              shuffle=False, split="train", **kw))
    except RecipeError as exc:
        assert len(exc.lines()) == 1
        return exc.lines()[0]


# --- tar archives -------------------------------------------------------------------------------

def test_every_cut_of_a_plain_tar_is_all_or_refused(tmp_path):
    data = _tar_bytes()
    end = 2 * 512 * N  # the end-of-archive marker starts here
    path = tmp_path / "cut.tar"
    for cut in range(0, len(data), 128):
        path.write_bytes(data[:cut])
        outcome = _pairs(path)
        if cut >= end + 512:  # the first zero block is whole: a proper end
            assert outcome == N, cut
        else:
            assert isinstance(outcome, str) and "the archive is refused" in outcome, (cut, outcome)


def test_cut_between_members_names_offset_and_member(tmp_path):
    path = tmp_path / "half.tar"
    path.write_bytes(_tar_bytes()[: 10 * 1024])
    assert _pairs(path) == (f"data.tar_path: {path} ends at offset 10240 (after member "
                            "'s09.json') without the end-of-archive marker; it may be truncated "
                            "or corrupted; the archive is refused.")


def test_cut_inside_a_member_names_it(tmp_path):
    path = tmp_path / "half.tar"
    path.write_bytes(_tar_bytes()[: 10 * 1024 + 512 + 20])  # 20 bytes of member 10's data
    assert _pairs(path) == (f"data.tar_path: {path} member 's10.json' at offset 10240 is cut "
                            "short or damaged (ReadError: unexpected end of data); the archive is "
                            "refused.")


def test_corrupted_member_header_is_refused(tmp_path):
    data = bytearray(_tar_bytes())
    data[5 * 1024 + 100] ^= 0xFF  # inside the mode field of member 5's header
    path = tmp_path / "bad.tar"
    path.write_bytes(bytes(data))
    assert _pairs(path) == (f"data.tar_path: {path} has a damaged header at offset 5120 (after "
                            "member 's04.json'); it may be truncated or corrupted; the archive "
                            "is refused.")


def test_every_cut_of_a_tar_gz_is_all_or_refused(tmp_path):
    data = gzip.compress(_tar_bytes(), mtime=0)
    path = tmp_path / "cut.tar.gz"
    path.write_bytes(data)
    assert _pairs(path) == N
    for cut in list(range(0, len(data), 16)) + list(range(len(data) - 8, len(data))):
        path.write_bytes(data[:cut])
        outcome = _pairs(path)
        assert isinstance(outcome, str) and "the archive is refused" in outcome, (cut, outcome)


def test_truncated_tar_gz_names_where_it_broke(tmp_path):
    data = gzip.compress(_tar_bytes(), mtime=0)
    path = tmp_path / "t.tar.gz"
    path.write_bytes(data[: len(data) // 2])
    message = _pairs(path)
    assert message.startswith(f"data.tar_path: {path} ")
    assert "EOFError: Compressed file ended before the end-of-stream marker was reached" in message
    assert "offset" in message and "member" in message


def test_member_larger_than_the_bound_is_refused_before_reading(tmp_path):
    big = json.dumps({"prompt": "p", "chosen": "x" * 5000, "rejected": "y"}).encode()
    path = tmp_path / "big.tar.gz"
    path.write_bytes(gzip.compress(_tar_bytes(2, {"z-big.json": big}), mtime=0))
    assert _pairs(path, max_member_bytes=4096) == (
        f"data.tar_path: {path} member 'z-big.json' at offset 2048 holds {len(big):,} bytes, more "
        "than data.tar_member_max_bytes (4,096); the archive is refused. Raise "
        "data.tar_member_max_bytes if the sample is meant to be that big.")
    assert _pairs(path, max_member_bytes=len(big)) == 3


def test_tar_member_max_bytes_reaches_the_reader(tmp_path):
    path = tmp_path / "a.tar"
    path.write_bytes(_tar_bytes(2))
    with pytest.raises(RecipeError, match="more than data.tar_member_max_bytes \\(10\\)"):
        build_pair_source(DataConfig(tar_path=str(path), tar_member_max_bytes=10, validation=OFF))


def test_invalid_utf8_in_a_tar_member(tmp_path):
    path = tmp_path / "u.tar"
    path.write_bytes(_tar_bytes(1, {"z.json": b'{"prompt": "a",\n "chosen": "\xff"}'}))
    assert _pairs(path) == (f"data.tar_path: {path} member 'z.json' line 2: not valid UTF-8 "
                            "(invalid start byte). Save the samples as UTF-8.")


# --- DPO jsonl ----------------------------------------------------------------------------------

def _jsonl_error(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "p.jsonl"
    path.write_bytes(data)
    with pytest.raises(RecipeError) as info:
        build_pair_source(DataConfig(jsonl_path=str(path), validation=OFF))
    return str(info.value).replace(str(path), "P")


def test_dpo_jsonl_invalid_utf8_names_the_line(tmp_path):
    good = _sample(0) + b"\n"
    assert _jsonl_error(tmp_path, good + b"\n" + good.replace(b"good", b"g\xc3od")) == (
        "data.jsonl_path: P line 3: not valid UTF-8 (invalid continuation byte at byte 30 of the "
        "line). Save the file as UTF-8.")


@pytest.mark.parametrize("value,kind,shown", [(3, "a number", "3"), (None, "null", "None"),
                                              (["a"], "a list", "['a']")])
def test_dpo_answers_that_are_not_text(tmp_path, value, kind, shown):
    row = {"prompt": "p", "chosen": value, "rejected": value}
    assert _jsonl_error(tmp_path, json.dumps(row).encode() + b"\n") == (
        f"data.jsonl_path: P line 1: the chosen is {kind}, not text (got {shown}). Write the "
        "chosen as a JSON string.")


def test_dpo_empty_jsonl(tmp_path):
    assert _jsonl_error(tmp_path, b"") == "data.jsonl_path: P is empty."
    assert _jsonl_error(tmp_path, b"\n \n") == "data.jsonl_path: P holds no preference pairs."


# --- data.path through datasets -----------------------------------------------------------------

@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _load_error(path: Path) -> str:
    with pytest.raises(RecipeError) as info:
        load_local(str(path), "train", key="data.path", split_key="data.split")
    return str(info.value).replace(str(path), "P")


def test_path_invalid_utf8_names_the_line(tmp_path, home):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b\xff"}\n')
    assert _load_error(path) == ("data.path: P line 2: not valid UTF-8 (invalid start byte at "
                                 "byte 14 of the line). Save the file as UTF-8.")


def test_path_empty_file(tmp_path, home):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n\n")
    assert _load_error(path) == "data.path: P is empty. Give a file with data rows."


def test_path_malformed_line_uses_editor_numbers_and_leaves_no_cache(tmp_path, home):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n{"prompt": "c"}\n')
    assert _load_error(path) == ("data.path: P line 3: not valid JSON (Expecting ',' delimiter "
                                 "at column 15). Write one JSON object per line.")
    cache = arrow_cache_dir()
    assert cache == home / "datasets"
    left = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert left in ([], [cache / ".posttrain-readers.lock"]), left  # the readers' lock stays


def test_path_arrow_cache_goes_under_the_project_home(tmp_path, home):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    ds, _ = load_local(str(path), "train", key="data.path", split_key="data.split")
    assert [row["prompt"] for row in ds] == ["a", "b"]
    assert list((home / "datasets").rglob("*.arrow"))


def test_a_failed_read_leaves_another_reads_files_alone(tmp_path, home):
    """Reads of the cache take turns across processes (ranks of a run, a second run): a read
    waits while another writes, and a failed read's cleanup removes its own leftovers only,
    never what the other read wrote."""
    import fcntl
    import threading

    cache = arrow_cache_dir()
    cache.mkdir(parents=True)
    other = open(cache / ".posttrain-readers.lock", "a")
    fcntl.flock(other, fcntl.LOCK_EX)  # the other read, under way
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n{"prompt": "c"}\n')
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.append(_load_error(bad)))
    reader.start()
    reader.join(timeout=3)
    assert reader.is_alive() and not errors  # it waits for the other read
    (cache / "other-read.arrow").write_bytes(b"the other read's file")
    fcntl.flock(other, fcntl.LOCK_UN)
    other.close()
    reader.join(timeout=30)
    assert not reader.is_alive() and errors and "not valid JSON" in errors[0], errors
    left = sorted(p.name for p in cache.rglob("*") if p.is_file())
    assert left == [".posttrain-readers.lock", "other-read.arrow"], left


# --- through the CLI ----------------------------------------------------------------------------

@pytest.mark.parametrize("recipe,key", [("recipes/dpo-arith.toml", "data.jsonl_path"),
                                        ("recipes/grpo-arith.toml", "data.path")])
def test_dry_run_refuses_invalid_utf8_with_one_line(run_cli, tmp_path, recipe, key):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(_sample(0) + b"\n" + _sample(1).replace(b"good", b"\xffgood") + b"\n")
    extra = ["data.synthetic_pairs=0"] if "dpo" in recipe else []
    rc, out, err = run_cli("--dry-run", "--plain", recipe, f"{key}={path}", *extra)
    assert rc == 2, out + err
    assert err.splitlines() == [f"{key}: {path} line 2: not valid UTF-8 (invalid start byte at "
                                "byte 29 of the line). Save the file as UTF-8."]
