"""The shared-prefix filter measures prefixes on the engine's token ids, the positions the loss
mask is laid on (not on a re-encoding of the decoded text, which can split differently)."""

from __future__ import annotations

from runner.rollout.base import Completion
from runner.train.loops.rollouts import shared_prefixes
from runner.train.loops.trajectory import Trajectory
from runner.types import ObsBundle


def test_prefixes_come_from_engine_token_ids():
    item = ObsBundle("1+1=")
    # Both decode to the same text, but the engine sampled different ids from the first token.
    comps = (Completion((7, 8, 9), "ab", (0.0,) * 3, "length"),
             Completion((70, 9), "ab", (0.0,) * 2, "length"),
             Completion((1, 2, 3), "x", (0.0,) * 3, "length"),
             Completion((1, 2), "y", (0.0,) * 2, "length"))
    traj = Trajectory((item,) * 4, ((0,),) * 4, comps)
    # the last group shares [1, 2]; each sequence keeps at least its last token
    assert shared_prefixes(traj, 2) == [0, 0, 2, 1]
