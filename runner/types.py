"""Canonical items that cross the data -> packer boundary."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class MediaOrigin:
    """Where an item came from, for errors about its media or its prompt: the row (e.g. "row 3
    of ...") and the source's image, video and prompt column names."""

    where: str = ""
    image_column: str = ""
    video_column: str = ""
    prompt_column: str = ""


@attrs.frozen
class ObsBundle:
    """One prompt item in canonical form, whatever the source's column names were.

    ``prompt`` is the user-facing prompt text (or chat messages); ``reference`` the reference
    answer ("" when the source has none). PPO sources may also carry ``images``, ``videos``,
    a stable ``id`` and an allowlisted ``metadata`` mapping; other algorithms leave them empty
    (GRPO and OPD items may carry images and videos too). ``origin`` says which row and columns
    the item came from (not part of its identity: it takes no part in equality).
    """

    prompt: Any
    reference: str = ""
    images: tuple[Any, ...] = ()
    videos: tuple[Any, ...] = ()
    id: str = ""
    metadata: dict[str, Any] = attrs.field(factory=dict)
    origin: MediaOrigin = attrs.field(default=MediaOrigin(), eq=False, repr=False)
    # tool schemas (OpenAI format) the chat template renders with the prompt: SFT's
    # data.tools_column
    tools: tuple[Any, ...] = ()
