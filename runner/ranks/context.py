"""RankContext: which rank of how many this process is. The only code that reads the
launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); everything else is handed a
RankContext."""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@attrs.frozen
class RankContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of world {self.world_size} is not a valid rank")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankContext | None:
        """The context a launcher (torchrun, accelerate launch, this package's own) set up, or
        None when the process was not started by one."""
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env or "RANK" not in env:
            return None
        try:
            return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                       local_rank=int(env.get("LOCAL_RANK", env["RANK"])))
        except ValueError as exc:
            from runner.errors import RunnerError

            raise RunnerError(
                f"the launcher's environment is not a valid rank layout: {exc}") from None


SINGLE = RankContext()
