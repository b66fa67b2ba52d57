"""Roles in Ray actors of their own (``launch.placement = "separate"``): the rollout engine, the
frozen reference, the OPD teacher and the reward models.

A ``RolloutActor`` builds the recipe's engine (hf or vLLM) from the resolved recipe text, as a
rank would, and serves ``generate`` on token ids: the policy ranks keep the data (the global
cursor) and the packers, and send it prompts only. A rank reaches it through ``RemoteEngine``,
which has the ``RolloutEngine`` interface, so the loops do not change.

Weights: after each update rank 0 puts the policy's state dict (CPU tensors) into Ray's object
store once, every rollout actor loads that one object in place (``update_weights``), and the
ranks wait at a barrier until it is loaded (``RunContext.sync_weights``). Every call is bounded
by ``launch.collective_timeout_s``; a dead or silent actor is an ``ActorDied`` error naming it
(the loop adds the step).

The reference and the teacher: a ``FrozenActor`` loads the role's model (the policy's base
model, or ``algo.teacher_path``) and scores the batches the ranks send it (``RemoteFrozen``: the
``Frozen`` interface, ``logprobs`` and ``logits``); batches and results cross as CPU tensors.

A reward model (``reward.functions = ["model:PATH"]``): a ``RewardModelActor`` per model loads it
once and scores the completions every rank sends it (``RemoteReward``: a reward function,
``(completions, items) -> scores``), as the rank would have scored them itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from runner.errors import ActorDied, RunnerError
from runner.launch.payload import Payload
from runner.packers.base import as_engine_prompt
from runner.recipe.reward_names import model_rewards
from runner.recipe.schema import Recipe

FROZEN_ROLES = ("reference", "teacher")  # served by a FrozenActor under 'separate'


class _RoleActor:
    """What every role actor answers the driver's first call with (``ray_env.actor_hello``:
    its node and package versions)."""

    def hello(self) -> dict[str, Any]:
        from runner.launch.ray_env import actor_hello

        return actor_hello()


class RolloutActor(_RoleActor):
    """The rollout engine of a run, in a Ray actor of its own."""

    def __init__(self, index: int, payload: Payload) -> None:
        self.index = index
        self.payload = payload
        self.engine: Any = None

    def __repr__(self) -> str:  # Ray's prefix of this actor's log lines
        return f"rollout actor {self.index}"

    def build(self) -> str:
        """Build the engine now (the driver asks at start, so the first rollout does not wait)."""
        return self._engine().name

    def _engine(self) -> Any:
        if self.engine is None:
            from runner.launch.entry import enter_rank
            from runner.models import resolve_model_path
            from runner.precision import resolve
            from runner.rollout.lengths import stated_limit
            from runner.train.assembly.build import engine_for

            recipe = enter_rank(self.payload)
            path = resolve_model_path(recipe.model.path)
            self.engine = engine_for(recipe, path, resolve(recipe), stated_limit(recipe, path))
        return self.engine

    def generate(self, prompts: list[Any], sampling: Any, seeds: list[int] | None
                 ) -> list[Any]:
        return self._engine().generate(prompts, sampling, seeds)

    def update_weights(self, state: dict[str, Any]) -> int:
        """Load the policy's weights (one object of the store, shared by every actor)."""
        self._engine().update_weights(state.items())
        return len(state)


class FrozenActor(_RoleActor):
    """The frozen reference or teacher of a run, in a Ray actor of its own."""

    def __init__(self, role: str, payload: Payload) -> None:
        self.role = role
        self.payload = payload
        self.model: Any = None

    def __repr__(self) -> str:
        return f"{self.role} actor"

    def build(self, pad_free: bool = False) -> str:
        if self.model is None:
            from runner.launch.entry import enter_rank
            from runner.models import resolve_model_path
            from runner.precision import device_type, resolve
            from runner.train.roles import Frozen

            recipe = enter_rank(self.payload)
            path = (resolve_model_path(recipe.algo.teacher_path, key="algo.teacher_path")
                    if self.role == "teacher" else resolve_model_path(recipe.model.path))
            device = device_type(recipe)
            self.model = Frozen(path, recipe, device, pad_free,
                                bf16=resolve(recipe, device).train == "bf16")
        self.model.pad_free = pad_free  # the layout of the batches the ranks send
        return self.role

    def logprobs(self, batch: Any, temperature: float, pad_free: bool) -> tuple[Any, Any]:
        self.build(pad_free)
        lp, mask = self.model.logprobs(batch.to(self.model.device_type), temperature)
        return lp.cpu(), mask.cpu()

    def logits(self, batch: Any, pad_free: bool, keep_from: int = 0) -> Any:
        self.build(pad_free)
        return self.model.logits(batch.to(self.model.device_type), keep_from).cpu()


class RewardModelActor(_RoleActor):
    """One reward model of a run (``reward.functions[i] = "model:PATH"``), in a Ray actor of its
    own: it scores the completions of every rank, on its actor's device."""

    def __init__(self, key: str, path: str, payload: Payload) -> None:
        self.key, self.path, self.payload = key, path, payload
        self.reward: Any = None

    def __repr__(self) -> str:
        return f"reward model actor ({self.key})"

    def build(self) -> str:
        if self.reward is None:
            from runner.launch.entry import enter_rank
            from runner.precision import device_type
            from runner.rewards.model import ModelReward

            recipe = enter_rank(self.payload)
            m = recipe.model
            self.reward = ModelReward(self.path, self.key, device=device_type(recipe),
                                      dtype=m.dtype, trust_remote_code=m.trust_remote_code)
            self.reward.load()
        return self.key

    def score(self, completions: list[str], items: list[Any]) -> list[float]:
        self.build()
        return self.reward(completions, items)


@attrs.frozen
class RoleActors:
    """The role actors a rank calls (plain handles: Ray pickles them)."""

    rollout: tuple[Any, ...] = ()
    timeout_s: float = 300.0
    frozen: tuple[tuple[str, Any], ...] = ()  # (role, actor): "reference", "teacher"
    rewards: tuple[tuple[str, Any], ...] = ()  # (key, actor): "reward.functions[i]"

    def rollout_engine(self, ctx: Any) -> RemoteEngine:
        """Rank ``ctx.rank``'s engine: actor ``rank % len(rollout)``."""
        return RemoteEngine(self.rollout, ctx.rank % len(self.rollout), self.timeout_s)

    def frozen_of(self, role: str) -> Any:
        return dict(self.frozen).get(role)

    def remote_frozen(self, role: str, device: Any, pad_free: bool = False) -> RemoteFrozen:
        return RemoteFrozen(self.frozen_of(role), role, device, self.timeout_s, pad_free)

    def remote_rewards(self) -> dict[str, RemoteReward]:
        """The reward functions served by actors, by their ``reward.functions[i]`` key."""
        return {key: RemoteReward(actor, key, self.timeout_s) for key, actor in self.rewards}


class RemoteFrozen:
    """The ``Frozen`` interface of a model that lives in a ``FrozenActor``."""

    sharded = lockstep = False  # whole in its actor

    def __init__(self, actor: Any, role: str, device: Any, timeout_s: float,
                 pad_free: bool = False) -> None:
        self.actor, self.role, self.device, self.timeout_s = actor, role, device, timeout_s
        self.pad_free = pad_free

    def logprobs(self, batch: Any, temperature: float = 1.0) -> tuple[Any, Any]:
        ref = self.actor.logprobs.remote(batch.to("cpu"), temperature, self.pad_free)
        lp, mask = _get(ref, "scoring", f"the {self.role} actor", self.timeout_s)
        return lp.to(self.device), mask.to(self.device)

    def logits(self, batch: Any, keep_from: int = 0) -> Any:
        ref = self.actor.logits.remote(batch.to("cpu"), self.pad_free, keep_from)
        return _get(ref, "scoring", f"the {self.role} actor", self.timeout_s).to(self.device)


class RemoteReward:
    """A reward model's reward function whose model lives in a ``RewardModelActor``."""

    def __init__(self, actor: Any, key: str, timeout_s: float) -> None:
        self.actor, self.key, self.timeout_s = actor, key, timeout_s
        self.__name__ = key

    def __call__(self, completions: Sequence[str], items: Sequence[Any]) -> list[float]:
        ref = self.actor.score.remote(list(completions), list(items))
        return _get(ref, "scoring", f"the reward model actor ({self.key})", self.timeout_s)


def _get(refs: Any, what: str, who: str, timeout_s: float) -> Any:
    """``ray.get`` with the run's time bound; a dead, silent or failing actor is named."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ActorDied(f"{who} did not finish {what} within {timeout_s:g} s "
                        "(launch.collective_timeout_s)") from None
    except ray.exceptions.RayActorError as exc:
        lines = str(exc).strip().splitlines()
        raise ActorDied(f"{who} died during {what} ({lines[0] if lines else 'no reason'})"
                        ) from None
    except ray.exceptions.RayTaskError as exc:  # the role raised: its own error
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        raise RunnerError(f"{who}: {what} failed: {type(cause).__name__}: {cause}") from None


class RemoteEngine:
    """A ``RolloutEngine`` whose engine lives in a rollout actor."""

    name = "remote"
    shared = True  # rank 0 alone sends weights (to every actor)

    def __init__(self, actors: Sequence[Any], index: int, timeout_s: float) -> None:
        self.actors, self.index, self.timeout_s = tuple(actors), index, timeout_s

    def _get(self, refs: Any, what: str, who: str) -> Any:
        return _get(refs, what, who, self.timeout_s)

    def generate(self, prompts: Sequence[Any], sampling: Any,
                 seeds: Sequence[int] | None = None) -> list[Any]:
        # Engine prompts (the packer's ``EnginePrompt``: ids, and for a multimodal model its
        # media) are the project's own plain records; they travel as they are.
        ref = self.actors[self.index].generate.remote(
            [as_engine_prompt(p) for p in prompts], sampling,
            None if seeds is None else list(seeds))
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


def frozen_roles(roles: Sequence[str]) -> list[str]:
    """The frozen roles of a plan's ``roles`` (each gets an actor under 'separate')."""
    return [role for role in roles if role in FROZEN_ROLES]


def reward_model_actors(recipe: Recipe, roles: Sequence[str]) -> list[tuple[str, str]]:
    """(key, path) of each reward model of the recipe that gets an actor under 'separate'
    (those of a plan with the reward role)."""
    return model_rewards(recipe.reward.functions) if "reward" in roles else []


def start_role_actors(ray: Any, payload: Payload, recipe: Recipe, roles: Sequence[str],
                      env: dict[str, Any], at: Callable[[int], Any], first: int
                      ) -> tuple[dict[str, Any], RoleActors]:
    """Start the rollout actors, then one actor per frozen role of ``roles``, then one per reward
    model, in the placement group's bundles from ``first`` on (``at(bundle)``: the scheduling
    strategy of a bundle).
    Returns the actors by name (for the driver's watch) and the ranks' view of them."""
    launch = recipe.launch
    n = launch.rollout_actors

    def options(cls: Any, bundle: int) -> Any:
        return ray.remote(cls).options(
            num_cpus=launch.cpus_per_role_actor, num_gpus=launch.gpus_per_role_actor,
            runtime_env=env, scheduling_strategy=at(bundle), max_restarts=0)

    rollout = [options(RolloutActor, first + i).remote(i, payload) for i in range(n)]
    frozen = [(role, options(FrozenActor, first + n + i).remote(role, payload))
              for i, role in enumerate(frozen_roles(roles))]
    first += n + len(frozen)
    rewards = [(key, options(RewardModelActor, first + i).remote(key, path, payload))
               for i, (key, path) in enumerate(reward_model_actors(recipe, roles))]
    named = ({f"rollout actor {i}": a for i, a in enumerate(rollout)}
             | {f"{role} actor": a for role, a in frozen}
             | {f"reward model actor ({key})": a for key, a in rewards})
    return named, RoleActors(tuple(rollout), launch.collective_timeout_s, tuple(frozen),
                             tuple(rewards))
