"""Canonical items that cross the data -> packer boundary."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class ObsBundle:
    """One prompt item in canonical form, whatever the source's column names were.

    ``prompt`` is the user-facing prompt text (or chat messages); ``reference`` the reference
    answer ("" when the source has none). PPO sources may also carry ``images``, ``videos``,
    a stable ``id`` and an allowlisted ``metadata`` mapping; other algorithms leave them empty.
    """

    prompt: Any
    reference: str = ""
    images: tuple[Any, ...] = ()
    videos: tuple[Any, ...] = ()
    id: str = ""
    metadata: dict[str, Any] = attrs.field(factory=dict)
