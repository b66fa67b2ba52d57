"""Rollouts that overlap training (``algo.max_off_policy_steps = k >= 1``).

The schedule is fixed, so an overlapped run is as reproducible as a synchronous one: the batch
of step ``t`` is sampled by the engine holding the policy of version ``v = max(0, t - 1 - k)``
(a version counts the optimizer steps behind the weights). While step ``t`` trains, a producer
thread samples the batch of step ``t + k`` with the engine's weights of version ``t - 1``;
the new weights reach the engine only after that batch is complete, so no batch is sampled with
two versions. The producer draws from the same data cursor, in the same order, as the
synchronous loop, and each item's sampling seed comes from its step and position, as there.

A loop may give the producer its reward stage (``Producer.reward_with``: GRPO and PPO do): each
batch is then rewarded right after it is sampled, by the same call with the same step as the
loop's ``score`` would make, so slow rewards (programs run in worker processes) overlap the
training too, and the results are the same bit for bit. The reward stage never runs on two
threads at once: the producer rewards on its thread only the batch it sampled there, and the
training thread rewards only before it starts the producer (the first batches, sampled in
``take``, and those a checkpoint held). A reward stage that fails keeps its failure with the
batch, and the step that takes the batch raises it: the run fails at that step, as it would have
synchronously.

A loop may also give the producer its own sampler (``Producer.sample_with``): GRPO's dynamic
sampling draws each step's batches there (``dynamic.draw_ahead``), deciding how many from every
rank's groups. That sampler rewards as it draws and keeps its rewards (``keeps_rewards``).

A checkpoint after step ``t`` holds the batches of steps ``t + 1 .. t + k`` (each rank's: token
ids, the engine's logprobs, the item indices, the version; not their rewards, except those a
sampler keeps) and the cursor where the producer stands, so a resumed run trains exactly the
batches the uninterrupted run trains (it rewards those it reads back again, on the training
thread, with the same result). The producer makes no collective call on the training thread's
process group: whatever needs every rank (the item ids of the log, dynamic sampling's kept
groups) is gathered when the batch is trained, and dynamic sampling's draws talk to the other
ranks over a process group of their own (``Collective.beside``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from runner.errors import Problem, RecipeError, RunnerError, RuntimeFailure
from runner.ranks.collective import Collective
from runner.rollout.base import Completion
from runner.state.load import LoadedCheckpoint
from runner.train.loops.trajectory import Trajectory
from runner.types import ObsBundle


@attrs.frozen
class Produced:
    """One rank's batch of one step, sampled ahead by the engine of policy ``version`` and,
    with a reward stage, rewarded (``traj.rewarded``) or holding the stage's ``failure``."""

    step: int
    version: int
    traj: Trajectory
    indices: tuple[int, ...]  # the source index of each completion's item
    seconds: float  # the producer's time sampling it (0 once read back from a checkpoint)
    reward_seconds: float = 0.0  # the producer's time rewarding it (0: not rewarded by it)
    # what the reward stage raised (the batch stays unrewarded); ``take`` raises it
    failure: RunnerError | None = attrs.field(default=None, eq=False, repr=False)
    # the sampler rewarded it (dynamic sampling: the rewards decided what it drew), so a
    # checkpoint keeps its rewards and a resumed run decides on the very same ones
    keeps_rewards: bool = False

    def to_json(self) -> dict[str, Any]:
        t = self.traj
        return {"step": self.step, "version": self.version, "indices": list(self.indices),
                "prompt_ids": [list(p) for p in t.prompt_ids],
                "completions": [[list(c.token_ids), c.text, list(c.logprobs), c.finish_reason,
                                 *([list(c.segments)] if c.segments else [])]
                                for c in t.completions],
                **({"loss_masks": [list(m) for m in t.loss_masks],
                    "env_rewards": list(t.env_rewards), "env_stats": dict(t.env_stats)}
                   if t.loss_masks else {}),
                **({"rewards": list(t.rewards), "reward_parts": dict(t.reward_parts)}
                   if self.keeps_rewards else {})}

    @classmethod
    def from_json(cls, raw: dict[str, Any], item: Callable[[int], ObsBundle]) -> Produced:
        """A batch read back from a checkpoint; its items read again from the source (rewarded
        when the checkpoint kept its rewards)."""
        items: dict[int, ObsBundle] = {}
        indices = tuple(int(i) for i in raw["indices"])
        for i in indices:
            if i not in items:
                items[i] = item(i)
        completions = tuple(Completion(tuple(ids), text, tuple(lps), reason,
                                       tuple(int(s) for s in (rest[0] if rest else ())))
                            for ids, text, lps, reason, *rest in raw["completions"])
        traj = Trajectory(tuple(items[i] for i in indices),
                          tuple(tuple(p) for p in raw["prompt_ids"]), completions,
                          loss_masks=tuple(tuple(m) for m in raw.get("loss_masks", [])),
                          env_rewards=tuple(float(r) for r in raw.get("env_rewards", [])),
                          env_stats={k: float(v) for k, v in raw.get("env_stats", {}).items()})
        kept = "rewards" in raw
        if kept:
            traj = attrs.evolve(traj, rewards=tuple(float(r) for r in raw["rewards"]),
                                reward_parts={k: float(v) for k, v in raw["reward_parts"].items()},
                                rewarded=True)
        return cls(int(raw["step"]), int(raw["version"]), traj, indices, 0.0, keeps_rewards=kept)


# what a producer samples: step -> (the trajectory, its items' source indices); a trajectory
# that comes rewarded keeps its rewards (``Produced.keeps_rewards``)
Sampler = Callable[[int], tuple[Trajectory, list[int]]]
# a loop's reward stage: (a step's trajectory, that step) -> the trajectory rewarded
Rewarder = Callable[[Trajectory, int], Trajectory]


class Producer:
    """The batches of the next ``k`` steps, sampled ahead on a thread of this rank.

    ``take(t)`` returns step ``t``'s batch (sampling it here when none is ahead: the first
    steps, or after a resume without batches in flight); ``start(t)`` samples step ``t``'s batch
    on the producer thread with the engine's current weights (version ``version``); ``wait()``
    returns once that batch is complete, raising what the producer's sampling raised. No batch
    is ever sampled for a step past ``last_step`` (the run's last; 0: no last step).

    With a reward stage (``reward``, or ``reward_with`` before the first ``take``) every batch
    is rewarded right after it is sampled, on the thread that sampled it; ``take`` rewards the
    batches a checkpoint held (on the calling thread, in step order) and raises a batch's
    reward failure when its step takes it. ``sample_with`` (before the first ``take``) gives it
    a loop's own sampler.
    """

    def __init__(self, sample: Sampler, k: int, in_flight: list[Produced] | None = None,
                 threads: int = 0, last_step: int = 0, reward: Rewarder | None = None) -> None:
        self.sample, self.k, self.threads = sample, k, threads
        self.last_step = last_step
        self.reward = reward
        self.ahead: deque[Produced] = deque(in_flight or [])
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def reward_with(self, reward: Rewarder) -> None:
        """Reward every batch with ``reward`` from now on (the loop's reward stage; given before
        the first ``take``, while no batch is being sampled)."""
        if self._thread is not None:
            raise RunnerError("the producer's reward stage is set while it samples")
        self.reward = reward

    def sample_with(self, sample: Sampler) -> None:
        """Sample every batch with ``sample`` from now on (a loop's own draw: GRPO's dynamic
        sampling; given before the first ``take``, while no batch is being sampled)."""
        if self._thread is not None:
            raise RunnerError("the producer's sampler is set while it samples")
        self.sample = sample

    def _produce(self, step: int, version: int) -> Produced:
        started = time.perf_counter()
        traj, indices = self.sample(step)
        return self._rewarded(Produced(step, version, traj, tuple(indices),
                                       time.perf_counter() - started,
                                       keeps_rewards=traj.rewarded))

    def _rewarded(self, produced: Produced) -> Produced:
        """``produced`` rewarded by the reward stage (as it is without one, or once rewarded);
        a failure is kept on it, the batch unrewarded (a checkpoint may still hold it)."""
        if self.reward is None or produced.traj.rewarded or produced.failure is not None:
            return produced
        import torch

        started = time.perf_counter()
        try:
            with torch.no_grad():  # (never differentiated; the grad mode is the thread's own)
                traj = self.reward(produced.traj, produced.step)
        except RunnerError as exc:  # RewardFailure: names the function and the item
            return attrs.evolve(produced, failure=exc)
        except Exception as exc:  # noqa: BLE001 - named, as a sampling failure is
            failure = RuntimeFailure("producer", produced.step, f"rewarding failed: "
                                     f"{type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            return attrs.evolve(produced, failure=failure)
        if not traj.rewarded:
            raise RunnerError(f"the reward stage left step {produced.step}'s batch unrewarded")
        return attrs.evolve(produced, traj=traj, reward_seconds=time.perf_counter() - started)

    def _last(self) -> int:
        return self.ahead[-1].step if self.ahead else 0

    def take(self, step: int) -> Produced:
        """Step ``step``'s batch; the batches up to ``step + k - 1`` (and at most the last
        step's) are ahead afterwards (those missing are sampled here, by the engine of version
        ``step - 1``), rewarded when there is a reward stage (those a checkpoint held are
        rewarded here). Raises the batch's reward failure, if it has one."""
        self.wait()
        end = min(step + self.k, self.last_step + 1) if self.last_step else step + self.k
        for missing in range(max(step, self._last() + 1), max(end, step + 1)):
            self.ahead.append(self._produce(missing, step - 1))
        self.ahead = deque(self._rewarded(p) for p in self.ahead)
        got = self.ahead.popleft()
        if got.step != step:
            raise RunnerError(f"the producer's next batch is of step {got.step}, not {step}")
        if got.failure is not None:
            raise got.failure
        return got

    def start(self, step: int, version: int) -> None:
        """Sample step ``step``'s batch on the producer thread (unless it is ahead already, or
        past the last step)."""
        if step <= self._last() or (self.last_step and step > self.last_step):
            return
        import torch

        # CUDA's current device is per thread: a new thread starts on device 0, not on the
        # rank's device that the training thread chose (torchrun ranks 1 .. N-1)
        cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def body() -> None:
            if cuda is not None:
                torch.cuda.set_device(cuda)
            if self.threads:  # this thread's own (OpenMP keeps the count per thread)
                torch.set_num_threads(self.threads)
            try:
                self.ahead.append(self._produce(step, version))
            except RunnerError as exc:  # handed to the training thread, which raises it
                self._failed = exc
            except Exception as exc:  # noqa: BLE001 - the same, named
                failure = RuntimeFailure("producer", step, f"sampling failed: "
                                         f"{type(exc).__name__}: {exc}")
                failure.__cause__ = exc
                self._failed = failure

        self._thread = threading.Thread(target=body, name=f"producer-step-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    def to_json(self) -> list[dict[str, Any]]:
        """The batches ahead (the producer is idle: called between steps), without their
        rewards: a resumed run rewards them again."""
        return [p.to_json() for p in self.ahead]


def refuse_in_flight(ckpt: LoadedCheckpoint | None, k: int, world: int) -> None:
    """A checkpoint's batches in flight are trained only by a run that samples ``k`` steps
    ahead, as the run that wrote them did, on as many ranks (raises RecipeError otherwise)."""
    flights = ckpt.state.in_flight if ckpt is not None else []
    held = sum(len(batches) for batches in flights)
    if not held or ckpt is None:
        return
    wrote = ckpt.state.off_policy_steps
    if k == 0 or len(flights) != world or (wrote is not None and wrote != k):
        by = f" with max_off_policy_steps = {wrote}" if wrote is not None else ""
        raise RecipeError([Problem(
            "algo.max_off_policy_steps", f"the checkpoint {ckpt.path.name} holds {held} "
            f"batch(es) sampled ahead by {len(flights)} rank(s){by}, which this run "
            f"(max_off_policy_steps = {k}, {world} rank(s)) would not train", got=k,
            hint="resume with the max_off_policy_steps and number of ranks that wrote it")])


def held_in_flight(ckpt: LoadedCheckpoint | None, rank: int,
                   item: Callable[[int], ObsBundle]) -> list[Produced]:
    """Rank ``rank``'s batches that checkpoint ``ckpt`` holds in flight (``refuse_in_flight``
    passed), their items read back by index with ``item``."""
    flights = ckpt.state.in_flight if ckpt is not None else []
    return [Produced.from_json(raw, item) for raw in (flights[rank] if flights else [])]


def staleness_metrics(comm: Collective, produced: Produced, step: int, k: int
                      ) -> dict[str, float]:
    """``rollout/staleness_mean`` and ``_max`` over every rank's batch: the optimizer steps
    between the policy that sampled it and the one it trains (at most ``k``)."""
    staleness = step - 1 - produced.version
    if not 0 <= staleness <= k:
        raise RunnerError(f"step {step} would train on a batch of policy version "
                          f"{produced.version}, {staleness} steps old (at most {k} allowed)")
    every = comm.gather(staleness)
    return {"rollout/staleness_mean": sum(every) / len(every),
            "rollout/staleness_max": float(max(every))}
