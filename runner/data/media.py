"""Images and videos of prompt items: decoding, frame sampling, and errors that name the item.

An item's media stay as the source gave them (paths, raw bytes, ``{"bytes"|"path": ...}``
mappings as ``datasets`` stores them, PIL images, or for a video a list of frames) until a
multimodal packer asks for them: ``load_image`` returns a PIL RGB image, ``load_video`` a
``VideoClip`` (frames sampled uniformly, with the fps and frame indices the model's processor
needs for its timestamps). Video files are decoded with PyAV.

``decode_media`` decodes an item's media for the packer that feeds them to the model: a bad
one (an unreadable image, a video that fails to decode, a number in an image column) is a
``RecipeError`` naming the row and the column, raised while the rollout of its batch is being
prepared, so nothing is trained on that batch. Membership ids never come through here (they
read no media).
"""

from __future__ import annotations

import io
import os
import re
import stat
import warnings
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from runner.errors import Problem, RecipeError
from runner.types import ObsBundle

MAX_IMAGE_PIXELS = 8192 * 8192  # larger images are refused unread (decompression bombs)
MAX_ASPECT = 200  # longest side / shortest side: vision processors refuse 200 and beyond
MAX_VIDEO_FRAMES = 100_000  # a video of more frames is refused before it is decoded
MAX_FRAMES = 8  # frames sampled from a video file (an even number: 2 frames per temporal patch)
FRAMES_FPS = 2.0  # the fps assumed for a video given as a list of frames


class MediaError(ValueError):
    """A medium that cannot be decoded; the message says why."""


@attrs.frozen(eq=False)
class VideoClip:
    """Sampled frames [T, H, W, 3] uint8 and where they came from: ``fps`` and
    ``total_num_frames`` of the source, ``frames_indices`` of the sampled frames in it."""

    frames: np.ndarray
    fps: float
    frames_indices: tuple[int, ...]
    total_num_frames: int

    def metadata(self) -> dict[str, Any]:
        """The metadata a Qwen-VL processor (and vLLM's) reads to place frame timestamps."""
        t, h, w = self.frames.shape[:3]
        return {"total_num_frames": self.total_num_frames, "fps": self.fps,
                "width": int(w), "height": int(h),
                "duration": self.total_num_frames / self.fps,
                "frames_indices": list(self.frames_indices), "video_backend": "pyav"}


def _raw_bytes(value: Any) -> bytes | None:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if (isinstance(value, Mapping)
            and isinstance(value.get("bytes"), bytes | bytearray | memoryview)):
        return bytes(value["bytes"])
    return None


def _path(value: Any) -> str | None:
    if isinstance(value, str | os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping) and isinstance(value.get("path"), str) and value["path"]:
        return value["path"]
    return None


def _kind(mode: int) -> str:
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
            else "a device or socket")


def check_regular_file(path: str) -> None:
    """A MediaError unless ``path`` is a regular file (a FIFO would block its reader)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise MediaError(f"cannot open {path} ({exc.strerror or exc})") from exc
    if not stat.S_ISREG(mode):
        raise MediaError(f"{path} is {_kind(mode)}, not a regular file")


def read_regular_file(path: str) -> bytes:
    """The bytes of the regular file at ``path``. Anything else (a FIFO, a device, a folder) is
    a MediaError: it is opened without blocking and refused before any read, so a named pipe
    cannot hang the run."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise MediaError(f"cannot open {path} ({exc.strerror or exc})") from exc
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise MediaError(f"{path} is {_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return handle.read()


def load_image(value: Any) -> Any:
    """A PIL RGB image from a PIL image, raw bytes, a path, or a ``{"bytes"|"path"}`` mapping.

    An image of more than ``MAX_IMAGE_PIXELS`` pixels is refused from its header, before it is
    decoded (a decompression bomb: a few KB of PNG that decode to gigabytes)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    data, path = _raw_bytes(value), _path(value)
    if data is None and path is None:
        raise MediaError(f"a {type(value).__name__} is not an image (give a path, raw bytes or "
                         "a PIL image)")
    if data is None:
        data = read_regular_file(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                check_size(*img.size)
                return img.convert("RGB")
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        found = re.search(r"\((\d+) pixels\)", str(exc))  # PIL's own, larger limit
        raise MediaError(_too_many_pixels(f"{int(found[1]):,}" if found else "more")) from None
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise MediaError(f"cannot read the image ({type(exc).__name__}: {exc})") from exc


def check_size(width: int, height: int, what: str = "image") -> None:
    """An image (or a video's frame) of ``width`` x ``height`` that a run can use: at most
    ``MAX_IMAGE_PIXELS`` pixels, not empty, and an aspect ratio under ``MAX_ASPECT`` (a
    vision-language processor refuses a 500 x 2 picture with a traceback)."""
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaError(_too_many_pixels(f"{width} x {height}"))
    if min(width, height) < 1 or max(width, height) >= MAX_ASPECT * min(width, height):
        raise MediaError(f"the {what} is {width} x {height} pixels: its aspect ratio (longest "
                         f"side / shortest side) must be under {MAX_ASPECT}")


def _too_many_pixels(size: str) -> str:
    return (f"the image has {size} pixels, more than the limit of {MAX_IMAGE_PIXELS:,} "
            "(8192 x 8192); it is refused before decoding")


def sample_indices(total: int, max_frames: int = MAX_FRAMES) -> list[int]:
    """Uniformly spaced frame indices: min(total, max_frames) of them, rounded down to an even
    count (at least 2; a 1-frame video repeats its frame).

    >>> sample_indices(20)
    [0, 3, 5, 8, 11, 14, 16, 19]
    >>> sample_indices(3)
    [0, 2]
    """
    n = max(2, min(total, max_frames) // 2 * 2)
    if total <= 1:
        return [0] * n
    return [int(round(i * (total - 1) / (n - 1))) for i in range(n)]


def load_video(value: Any) -> VideoClip:
    """A ``VideoClip`` from a video file (path, bytes or mapping; decoded with PyAV) or a list
    of frames (PIL images or HxWx3 arrays, taken at ``FRAMES_FPS``)."""
    if isinstance(value, VideoClip):
        return value
    if isinstance(value, list | tuple):
        if not value:
            raise MediaError("an empty list of frames is not a video")
        try:
            frames = np.stack([np.asarray(load_image(f) if not isinstance(f, np.ndarray) else f,
                                          dtype=np.uint8) for f in value])
        except (MediaError, ValueError) as exc:
            raise MediaError(f"the frames are not one video ({exc})") from exc
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise MediaError(f"frames must be HxWx3 (got {frames.shape[1:]})")
        idx = sample_indices(len(frames), max(MAX_FRAMES, len(frames)))
        return VideoClip(frames[idx], FRAMES_FPS, tuple(idx), len(frames))
    data, path = _raw_bytes(value), _path(value)
    if data is None and path is None:
        raise MediaError(f"a {type(value).__name__} is not a video (give a path, raw bytes or a "
                         "list of frames)")
    import av

    if data is None:
        check_regular_file(path)

    def opened() -> Any:
        return av.open(io.BytesIO(data) if data is not None else path)

    # Two passes: the packets are counted without decoding, then only the sampled frames are
    # kept as arrays while the stream is decoded (a long 720p video held whole took gigabytes).
    try:
        with opened() as container:
            stream = container.streams.video[0]
            check_size(stream.codec_context.width, stream.codec_context.height, "video")
            total = sum(1 for packet in container.demux(stream) if packet.size)
        if total > MAX_VIDEO_FRAMES:
            raise MediaError(f"the video has {total:,} frames, more than the limit of "
                             f"{MAX_VIDEO_FRAMES:,}; it is refused before decoding")
        wanted = sample_indices(max(total, 1))
        kept: dict[int, np.ndarray] = {}
        with opened() as container:
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else FRAMES_FPS
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    kept[i] = frame.to_ndarray(format="rgb24")
                if i >= wanted[-1]:
                    break
    except (av.FFmpegError, OSError, IndexError, ValueError) as exc:
        if isinstance(exc, MediaError):
            raise
        raise MediaError(f"cannot decode the video ({type(exc).__name__}: {exc})") from exc
    if not kept:
        raise MediaError("the video has no frames")
    # A stream that decodes fewer frames than it has packets: the last frame stands in.
    last = kept[max(kept)]
    frames = [kept.get(i, last) for i in wanted]
    return VideoClip(np.stack(frames), fps, tuple(wanted), max(total, len(kept)))


def decode_media(item: ObsBundle) -> tuple[tuple[Any, ...], tuple[VideoClip, ...]]:
    """The item's images (PIL RGB) and videos (``VideoClip``); the first that cannot be decoded
    is a RecipeError naming the item's row (``item.origin``), the column and the medium's
    position in it."""
    origin = item.origin
    images, videos = [], []
    for media, column, key, load, out in (
            (item.images, origin.image_column, "data.image_column", load_image, images),
            (item.videos, origin.video_column, "data.video_column", load_video, videos)):
        for k, value in enumerate(media):
            try:
                out.append(load(value))
            except MediaError as exc:
                kind = "image" if key == "data.image_column" else "video"
                where = f"{origin.where or 'an item'}: column {column or '?'!r}, {kind} {k}"
                raise RecipeError([Problem(key, f"{where}: {exc}", hint="fix or drop the row, "
                                           "or map it with data.items_fn")]) from None
    return tuple(images), tuple(videos)
