"""Roles in Ray actors of their own (``launch.placement = "separate"``): the rollout engine.

A ``RolloutActor`` builds the recipe's engine (hf or vLLM) from the resolved recipe text, as a
rank would, and serves ``generate`` on token ids: the policy ranks keep the data (the global
cursor) and the packers, and send it prompts only. A rank reaches it through ``RemoteEngine``,
which has the ``RolloutEngine`` interface, so the loops do not change.

Weights: after each update rank 0 puts the policy's state dict (CPU tensors) into Ray's object
store once, every rollout actor loads that one object in place (``update_weights``), and the
ranks wait at a barrier until it is loaded (``RunContext.sync_weights``). Every call is bounded
by ``launch.collective_timeout_s``; a dead or silent actor is an ``ActorDied`` error naming it
(the loop adds the step).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from runner.errors import ActorDied, RunnerError
from runner.launch.payload import Payload
from runner.recipe.schema import Recipe


class RolloutActor:
    """The rollout engine of a run, in a Ray actor of its own."""

    def __init__(self, index: int, payload: Payload) -> None:
        self.index = index
        self.payload = payload
        self.engine: Any = None

    def __repr__(self) -> str:  # Ray's prefix of this actor's log lines
        return f"rollout actor {self.index}"

    def hello(self) -> dict[str, Any]:
        import ray

        from runner.launch.ray_backend import package_versions

        return {"versions": package_versions(), "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def build(self) -> str:
        """Build the engine now (the driver asks at start, so the first rollout does not wait)."""
        return self._engine().name

    def _engine(self) -> Any:
        if self.engine is None:
            from runner.models import resolve_model_path
            from runner.rollout.factory import make_engine
            from runner.ui.quiet import quiet_libraries

            os.chdir(self.payload.cwd)
            if self.payload.cwd not in sys.path:
                sys.path.insert(0, self.payload.cwd)
            quiet_libraries()
            recipe = self.payload.recipe()
            self.engine = make_engine(recipe, resolve_model_path(recipe.model.path))
        return self.engine

    def generate(self, prompts: list[list[int]], sampling: Any, seeds: list[int] | None
                 ) -> list[Any]:
        return self._engine().generate(prompts, sampling, seeds)

    def update_weights(self, state: dict[str, Any]) -> int:
        """Load the policy's weights (one object of the store, shared by every actor)."""
        self._engine().update_weights(state.items())
        return len(state)


@attrs.frozen
class RoleActors:
    """The role actors a rank calls (plain handles: Ray pickles them)."""

    rollout: tuple[Any, ...] = ()
    timeout_s: float = 300.0

    def rollout_engine(self, ctx: Any) -> RemoteEngine:
        """Rank ``ctx.rank``'s engine: actor ``rank % len(rollout)``."""
        return RemoteEngine(self.rollout, ctx.rank % len(self.rollout), self.timeout_s)


class RemoteEngine:
    """A ``RolloutEngine`` whose engine lives in a rollout actor."""

    name = "remote"
    shared = True  # rank 0 alone sends weights (to every actor)

    def __init__(self, actors: Sequence[Any], index: int, timeout_s: float) -> None:
        self.actors, self.index, self.timeout_s = tuple(actors), index, timeout_s

    def _get(self, refs: Any, what: str, who: str) -> Any:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ActorDied(f"{who} did not finish {what} within {self.timeout_s:g} s "
                            "(launch.collective_timeout_s)") from None
        except ray.exceptions.RayActorError as exc:
            lines = str(exc).strip().splitlines()
            raise ActorDied(f"{who} died during {what} ({lines[0] if lines else 'no reason'})"
                            ) from None
        except ray.exceptions.RayTaskError as exc:  # the engine raised: its own error
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            raise RunnerError(f"{who}: {what} failed: {type(cause).__name__}: {cause}") from None

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Any,
                 seeds: Sequence[int] | None = None) -> list[Any]:
        ref = self.actors[self.index].generate.remote(
            [list(p) for p in prompts], sampling, None if seeds is None else list(seeds))
        return self._get(ref, "a rollout", f"rollout actor {self.index}")

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        import ray

        state = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
        ref = ray.put(state)  # once, whatever the number of actors
        loads = [actor.update_weights.remote(ref) for actor in self.actors]
        for i, load in enumerate(loads):
            self._get(load, "a weight sync", f"rollout actor {i}")

    def close(self) -> None:
        """The driver stops the actors when the run ends."""


def start_rollout_actors(ray: Any, payload: Payload, recipe: Recipe, env: dict[str, Any],
                         placements: list[Any]) -> list[Any]:
    launch = recipe.launch
    cls = ray.remote(RolloutActor)
    return [cls.options(num_cpus=launch.cpus_per_rollout_actor,
                        num_gpus=launch.gpus_per_rollout_actor, runtime_env=env,
                        scheduling_strategy=where, max_restarts=0).remote(i, payload)
            for i, where in enumerate(placements)]
