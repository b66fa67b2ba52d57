"""The built-in image task: "What colour is the shape?" about a small picture of one shape.

Each item is a 32x32 PNG of one filled square or disc in one of four colours on a dark
background; the answer is the colour's name, so it depends on the image alone (every prompt has
the same text). Items are enumerated from their drawing parameters (colour, shape, position,
size) and split by a hash of those parameters into a training and a held-out pool, like the
arithmetic task: the pools never overlap whatever the counts asked for, and the membership id of
an item is its parameter key, which covers the image content and not only the prompt text.

Use it as a prompt source factory (``data.factory = "runner.data.shapes.build_shapes"`` with
``image_column = "image"``; the held-out set is ``data.validation.factory`` with
``factory_kwargs = { split = "held_out" }``).
"""

from __future__ import annotations

import hashlib
import io
import random

import attrs

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
SHAPES = ("square", "disc")
SIZE = 32  # pixels on a side
QUESTION = "What colour is the shape?"
HELD_OUT_SHARE = 0.2


@attrs.frozen
class Shape:
    colour: str
    shape: str
    x: int  # top-left corner
    y: int
    side: int

    @property
    def key(self) -> str:
        return f"shape:{self.colour}:{self.shape}:{self.x},{self.y},{self.side}"

    def image(self) -> object:
        """The picture as a PIL RGB image (deterministic in the parameters)."""
        from PIL import Image, ImageDraw

        img = Image.new("RGB", (SIZE, SIZE), (24, 24, 32))
        draw = ImageDraw.Draw(img)
        box = (self.x, self.y, self.x + self.side - 1, self.y + self.side - 1)
        if self.shape == "square":
            draw.rectangle(box, fill=COLOURS[self.colour])
        else:
            draw.ellipse(box, fill=COLOURS[self.colour])
        return img

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.image().save(buf, format="PNG")
        return buf.getvalue()


def _is_held_out(item: Shape) -> bool:
    digest = hashlib.sha256(item.key.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < HELD_OUT_SHARE


def shapes(split: str, count: int, seed: int = 0) -> list[Shape]:
    """``count`` items of ``split`` ("train" or "held_out"), deterministic in the arguments:
    the pool's items in a seeded order, cycled when ``count`` exceeds the pool."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    pool = [s for colour in COLOURS for shape in SHAPES for side in (10, 14, 18)
            for x in range(0, SIZE - side + 1, 3) for y in range(0, SIZE - side + 1, 3)
            if _is_held_out(s := Shape(colour, shape, x, y, side)) == (split == "held_out")]
    random.Random(f"shapes-{seed}-{split}").shuffle(pool)
    return [pool[i % len(pool)] for i in range(count)]


class ShapesDataset:
    """Rows ``{"question", "answer", "image" (PNG bytes), "key"}``, drawn when read."""

    def __init__(self, split: str = "train", count: int = 1000, seed: int = 0) -> None:
        self.split, self.count, self.seed = split, count, seed
        self._items = shapes(split, count, seed)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> dict[str, object]:
        s = self._items[index]
        return {"question": QUESTION, "answer": s.colour, "image": s.png(), "key": s.key}

    def cursor_fingerprint(self) -> str:
        return f"builtin-shapes-v1 split={self.split} count={self.count} seed={self.seed}"

    def membership_ids(self) -> tuple[str, ...]:
        """The drawing parameters of each item (no image is drawn)."""
        return tuple(s.key for s in self._items)


def build_shapes(split: str = "train", count: int = 1000, seed: int = 0) -> ShapesDataset:
    return ShapesDataset(split, count, seed)
