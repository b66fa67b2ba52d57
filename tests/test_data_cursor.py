"""The data cursor: JSON round trip, exact resume, and the strict / auto / off rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner.data.columns import ColumnMap
from runner.data.cursor import (
    DataCursor,
    IndexStream,
    PromptStream,
    check_resume,
    diff_parts,
    fingerprint_of,
)
from runner.data.sources import PromptSource
from runner.errors import ResumeError


class Recorder:
    """Rows that remember which indices were read."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, []

    def __call__(self, i: int) -> dict[str, str]:
        self.read.append(i)
        return {"prompt": f"p{i}", "answer": str(i)}


def source(n: int = 10, shuffle: bool = True) -> tuple[PromptSource, Recorder]:
    rows = Recorder(n)
    src = PromptSource(rows, n, kind="test", label="test rows", identity={"source": "test"},
                       columns=ColumnMap(prompt="prompt", response="answer"), shuffle=shuffle)
    return src, rows


def test_cursor_json_round_trip():
    cursor = DataCursor(epoch=3, position=17, seed=-2, fingerprint="ab" * 32)
    assert DataCursor.from_json(cursor.to_json()) == cursor


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"epoch": 0}',
                                  '{"epoch": "0", "position": 0, "seed": 0, "fingerprint": ""}',
                                  '{"epoch": -1, "position": 0, "seed": 0, "fingerprint": ""}'])
def test_damaged_cursor_json_is_a_resume_error(text):
    with pytest.raises(ResumeError, match=r"data\.cursor_resume: the saved data cursor"):
        DataCursor.from_json(text)


def test_stream_crosses_epochs_and_reports_the_cursor():
    src, _ = source(4, shuffle=False)
    stream = PromptStream(src, seed=0, shuffle=False)
    assert [b.prompt for b in stream.next_batch(3)] == ["p0", "p1", "p2"]
    assert (stream.cursor.epoch, stream.cursor.position) == (0, 3)
    assert [b.reference for b in stream.next_batch(3)] == ["3", "0", "1"]
    assert (stream.cursor.epoch, stream.cursor.position) == (1, 2)
    assert stream.cursor.fingerprint == src.fingerprint()
    assert [i for i, _ in stream.next_indexed(2)] == [2, 3]
    assert (stream.cursor.epoch, stream.cursor.position) == (2, 0)  # a full epoch rolls over


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), world=st.integers(1, 3), batch=st.integers(1, 6),
       before=st.integers(0, 8), after=st.integers(1, 8))
def test_resume_continues_exactly_where_the_straight_stream_goes(n, world, batch, before, after):
    for rank in range(world):
        straight = IndexStream(n, seed=4, shuffle=True, rank=rank, world=world, fingerprint="f")
        for _ in range(before):
            straight.next_indices(batch)
        resumed = IndexStream(n, seed=4, shuffle=True, rank=rank, world=world, fingerprint="f",
                              cursor=DataCursor.from_json(straight.cursor.to_json()))
        for _ in range(after):
            assert np.array_equal(resumed.next_indices(batch), straight.next_indices(batch))
        assert resumed.cursor == straight.cursor


def test_resume_reads_no_item_before_the_cursor():
    src, rows = source(100)
    straight = PromptStream(src, seed=1, shuffle=True)
    straight.next_batch(30)
    cursor = straight.cursor
    expected = [b.prompt for b in straight.next_batch(5)]
    src2, rows2 = source(100)
    resumed = PromptStream(src2, seed=1, shuffle=True, cursor=cursor)
    assert [b.prompt for b in resumed.next_batch(5)] == expected
    assert rows2.read == [int(p[1:]) for p in expected]  # only the five new items were read


def test_stream_refuses_a_cursor_of_other_data():
    src, _ = source(10)
    bad = DataCursor(0, 3, seed=0, fingerprint="0" * 64)
    with pytest.raises(ResumeError, match="fingerprint 0000000000000000... ->"):
        PromptStream(src, seed=0, shuffle=True, cursor=bad)
    with pytest.raises(ResumeError, match="seed 0 -> 1"):
        PromptStream(src, seed=1, shuffle=True,
                     cursor=DataCursor(0, 3, seed=0, fingerprint=src.fingerprint()))


def test_stream_shuffle_must_match_the_source():
    src, _ = source(10, shuffle=True)
    with pytest.raises(ValueError, match="shuffle"):
        PromptStream(src, seed=0, shuffle=False)


PARTS = {"source": "factory", "length": "1000", "shuffle": "true"}
SAVED = DataCursor(1, 5, seed=0, fingerprint=fingerprint_of(PARTS))


def test_off_always_starts_the_data_fresh():
    assert check_resume(SAVED, PARTS, PARTS, "off") is None
    assert check_resume(SAVED, {"length": "2"}, PARTS, "off") is None


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_matching_cursor_resumes(mode):
    assert check_resume(SAVED, dict(PARTS), PARTS, mode, seed=0) == SAVED


def test_auto_without_a_saved_cursor_starts_fresh_and_strict_fails():
    assert check_resume(None, PARTS, None, "auto") is None
    with pytest.raises(ResumeError) as info:
        check_resume(None, PARTS, None, "strict")
    assert str(info.value) == (
        "data.cursor_resume: the checkpoint has no saved data cursor, which strict resume "
        "requires (got 'strict'). Set data.cursor_resume=auto to start the data from the "
        "beginning when no cursor was saved, or off to never restore it.")


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_mismatch_names_the_part_and_the_way_out(mode):
    now = {**PARTS, "length": "1200"}
    with pytest.raises(ResumeError) as info:
        check_resume(SAVED, now, PARTS, mode)
    text = str(info.value)
    assert text.startswith(f"data.cursor_resume: the saved data cursor does not match the data "
                           f"now ({mode} resume): length 1000 -> 1200. ")
    assert "set data.cursor_resume=off for one migration run, then return to auto or strict" in text


def test_mismatch_without_saved_parts_shows_the_digests():
    with pytest.raises(ResumeError, match=r"fingerprint [0-9a-f]{16}\.\.\. -> [0-9a-f]{16}\.\.\."):
        check_resume(SAVED, {**PARTS, "length": "7"}, None, "strict")


def test_seed_change_is_a_mismatch():
    with pytest.raises(ResumeError, match="seed 0 -> 3"):
        check_resume(SAVED, PARTS, PARTS, "auto", seed=3)


def test_diff_parts_lists_added_and_removed_parts():
    assert diff_parts({"a": "1", "b": "x"}, {"a": "2", "c": ""}) == [
        "a 1 -> 2", "b x -> (absent)", "c (absent) -> ''"]
