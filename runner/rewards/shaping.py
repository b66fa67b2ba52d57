"""Shaping of the rewards a run trains on (never of the held-out rewards).

DAPO's overlong reward shaping (Yu et al. 2025, arXiv:2503.14476, "soft overlong punishment"):
a completion that runs into the last ``buffer_len`` tokens before ``max_tokens`` is penalised
linearly in how far it went, up to ``penalty`` at the limit.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


def overlong_penalty(length: int, max_tokens: int, buffer_len: int, penalty: float) -> float:
    """The shaping term of a completion of ``length`` tokens (<= 0).

    0 for length <= max_tokens - buffer_len; -(length - (max_tokens - buffer_len)) / buffer_len
    x penalty above it (-penalty at length = max_tokens, and beyond); 0 with buffer_len = 0.

    >>> [overlong_penalty(n, 8, 4, 1.0) for n in (4, 6, 8)]
    [0.0, -0.5, -1.0]
    """
    if buffer_len <= 0:
        return 0.0
    over = length - (max_tokens - buffer_len)
    return -min(over, buffer_len) / buffer_len * penalty if over > 0 else 0.0


@attrs.frozen
class Overlong:
    """The overlong shaping of a run: ``rollout.max_new_tokens`` and the ``reward.overlong_*``
    keys."""

    max_tokens: int
    buffer_len: int
    penalty: float

    def penalties(self, lengths: Sequence[int]) -> list[float]:
        """``overlong_penalty`` of each completion length."""
        return [overlong_penalty(n, self.max_tokens, self.buffer_len, self.penalty)
                for n in lengths]
