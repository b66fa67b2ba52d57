"""The Ray driver's answer to Ctrl-C, without a cluster: the first signal sets each rank task's
cancel flag and nothing more (a recursive cancel also cancels the ranks' queued calls to role
actors, e.g. one rank's rollout waiting behind another's, so that rank fails mid-step while the
others wait for it in a collective); the second kills every actor."""

from __future__ import annotations

import signal

from runner.launch.ray_backend import _Watch


class FakeRay:
    def __init__(self) -> None:
        self.cancelled: list[tuple[str, dict]] = []
        self.killed: list[str] = []

    def cancel(self, ref, **kwargs) -> None:
        self.cancelled.append((ref, kwargs))

    def kill(self, actor) -> None:
        self.killed.append(actor)


def test_first_signal_cancels_only_the_rank_tasks_second_kills_the_actors(capsys):
    ray = FakeRay()
    watch = _Watch(ray, ["rank0", "rank1"], {"rollout 0": "rollout-actor"})
    watch.refs = ["ref0", "ref1"]
    watch.forward(signal.SIGINT, None)
    assert ray.cancelled == [("ref0", {"recursive": False}), ("ref1", {"recursive": False})]
    assert ray.killed == [] and "stop requested" in capsys.readouterr().err
    watch.forward(signal.SIGINT, None)
    assert ray.killed == ["rank0", "rank1", "rollout-actor"] and len(ray.cancelled) == 2
