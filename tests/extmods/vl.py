"""Extensions of the multimodal tests: a user subclass of Qwen3VLDataPacker, and prompt sources
whose third row holds bad media."""

from __future__ import annotations

import io

from runner.data.shapes import QUESTION, shapes
from runner.packers import DataPacker, Qwen3VLDataPacker
from runner.types import ObsBundle

TAG = " Answer in one word."


class TaggedVLPacker(Qwen3VLDataPacker):
    """Adds a sentence to every prompt text; everything else is the built-in packer's."""

    def messages(self, item: ObsBundle) -> list[dict]:
        messages = super().messages(item)
        messages[-1]["content"][-1]["text"] += TAG
        return messages


def build_tagged_packer() -> DataPacker:
    return TaggedVLPacker()


BAD = {"unreadable": ("image", b"these bytes are no picture"),
       "number": ("image", 7),
       "video": ("video", b"\x00\x00\x00\x18ftypmp42 and then nothing")}


class BadMediaRows:
    """Four shape rows; row 2 holds the bad medium ``kind`` of ``BAD`` in its column."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        video = make_video() if kind == "video" else b""
        self.rows = [{"q": QUESTION, "a": s.colour, "image": s.png(), "video": video, "key": s.key}
                     for s in shapes("train", 4)]
        column, value = BAD[kind]
        self.rows[2][column] = value

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return dict(self.rows[index])

    def cursor_fingerprint(self) -> str:
        return f"bad-media-{self.kind}"

    def membership_ids(self) -> tuple[str, ...]:
        return tuple(r["key"] for r in self.rows)


def bad_media(kind: str = "unreadable", split: str = "train", count: int = 4) -> BadMediaRows:
    """(``split`` and ``count`` are accepted for recipes of the shapes task, and ignored.)"""
    return BadMediaRows(kind)


def make_video(frames: int = 6, fps: int = 4, size: int = 32) -> bytes:
    """An mp4 (mpeg4) of a red square moving right, written with PyAV."""
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            a = np.full((size, size, 3), 30, np.uint8)
            a[4:14, 2 + 2 * i:12 + 2 * i] = (220, 40, 40)
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()
