"""``launch.backend = "ray"``: the rank program as Ray actors in one placement group.

The driver (the ``posttrain-run`` process) has validated the recipe and imported every dotted
path before this runs. It then

- joins the cluster at ``launch.ray_address``, or starts a local single-node one sized from the
  recipe and bound to 127.0.0.1 only (stopped when the run ends);
- reserves one placement group: a bundle per policy rank (``cpus_per_rank`` / ``gpus_per_rank``)
  and, with ``placement = "separate"``, one per rollout actor; ``STRICT_PACK`` on a one-node
  cluster, ``PACK`` across nodes;
- starts one actor per bundle and compares every actor's package versions with its own (a
  mismatch is an error before anything is built);
- hands each rank actor plain data only (``Payload``: the resolved recipe text and its hash, the
  overrides, the working directory) and the rendezvous of rank 0's node; each actor builds its
  own datasets, packers and models from the recipe's dotted paths and runs ``run_rank``, as a
  torchrun rank would;
- watches the ranks: a rank or actor that dies stops the others and the run exits 1 naming it;
  the first Ctrl-C / SIGTERM asks every rank (through ``ray.cancel``, which a running actor task
  sees as a flag) to stop after an agreed step and checkpoint it, a second kills the actors.

Extension modules reach the actors through the driver's working directory and ``PYTHONPATH``
(every actor changes to that directory and puts it first on ``sys.path``); a remote cluster's
actors get them from ``launch.ray_runtime_env`` (``working_dir`` / ``py_modules``).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from runner.errors import RunnerError
from runner.launch.payload import Payload
from runner.launch.ray_env import (
    LOCAL_CLUSTER_ENV,
    actor_hello,
    package_versions,
    runtime_env,
    version_mismatches,
)
from runner.recipe.plan import RunPlan
from runner.recipe.schema import Recipe

LOOPBACK = "127.0.0.1"
POLL_S = 0.1
GRACE_S = 3.0  # after one rank failed, how long the others get to notice and exit
# Ray folds identical lines of several actors into one: every rank's line is kept. Ray's usage
# reports (sent to its vendor) stay off unless the user turns them on.
DRIVER_ENV = {"RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}


class RankActor:
    """One policy rank (a Ray actor; ``ray.remote`` is applied when a run starts, so this module
    imports without Ray)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.store: Any = None

    def __repr__(self) -> str:  # Ray's prefix of this actor's log lines
        return f"rank {self.rank}"

    def hello(self) -> dict[str, Any]:
        return actor_hello()

    def rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: host the ranks' TCPStore on this node's address; (address, port)."""
        import ray

        from runner.launch.torchrun import listening_store

        host = ray.util.get_node_ip_address()
        self.store = listening_store(host, timeout_s)
        return host, self.store[1]

    def run(self, payload: Payload, master: tuple[str, int], local_rank: int, local_world: int,
            roles: Any = None) -> tuple[int, str]:
        """The rank program; (exit code, the error lines it printed)."""
        import ray

        from runner.launch.entry import enter_rank, error_prefix, guarded, rank_plan
        from runner.launch.rank import run_rank
        from runner.ranks.context import RankContext

        host, port = master
        # What torchrun gives its workers: torch.distributed and Accelerate (which picks DDP
        # from it) read this environment.
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world),
                           "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world),
                           "MASTER_ADDR": host, "MASTER_PORT": str(port),
                           "TORCHELASTIC_USE_AGENT_STORE": "True"})
        if host == LOOPBACK:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        context = ray.get_runtime_context()
        ctx = RankContext(self.rank, self.world, local_rank)

        def body() -> int:
            recipe = enter_rank(payload)
            return run_rank(recipe, rank_plan(recipe, ctx), ctx, source=payload.source,
                            overrides=payload.overrides, plain=True, roles=roles,
                            stop=context.is_canceled, job=payload.job)

        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            code = guarded(body, error_prefix(ctx))
        return code, errors.getvalue()


def _init_ray(recipe: Recipe, roles: Sequence[str]) -> Any:
    """Join ``launch.ray_address``, or start a local cluster on 127.0.0.1 sized from the recipe."""
    launch = recipe.launch
    local = not launch.ray_address
    with_token = False
    # Ray would replace a loopback address by the host's other one.
    loopback = local or launch.ray_address.rsplit(":", 1)[0] in (LOOPBACK, "localhost")
    for name, value in {**DRIVER_ENV, **(LOCAL_CLUSTER_ENV if loopback else {})}.items():
        os.environ.setdefault(name, value)
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        import ray
    except ImportError:
        raise RunnerError("launch.backend = 'ray' needs Ray: pip install "
                          "'posttrain-runner[ray]'") from None
    import logging

    if not local:
        _probe(launch.ray_address, min(10.0, launch.collective_timeout_s))
        with_token = _use_cluster_token()
    options: dict[str, Any] = {"log_to_driver": True, "logging_level": logging.WARNING}
    if local:
        actors = _role_actors(recipe, roles)
        cpus = launch.num_processes * launch.cpus_per_rank + actors * launch.cpus_per_role_actor
        gpus = launch.num_processes * launch.gpus_per_rank + actors * launch.gpus_per_role_actor
        options.update(num_cpus=max(1, int(-(-cpus // 1))), num_gpus=int(-(-gpus // 1)),
                       include_dashboard=False, _node_ip_address=LOOPBACK)
    try:
        # "local": a cluster of this run's own, never one that RAY_ADDRESS or a
        # ray_current_cluster file left by another job points at (stale or someone else's).
        ray.init(address=launch.ray_address or "local", **options)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
        hint = ""
        if not local and not with_token and os.environ.get("RAY_AUTH_MODE") != "disabled":
            hint = (". No Ray token was found here: a cluster with token authentication (Ray's "
                    "default) refuses such a driver; copy its token (`ray get-auth-token` on "
                    "its head) to ~/.ray/auth_token, or set RAY_AUTH_TOKEN_PATH or "
                    "RAY_AUTH_TOKEN")
        raise RunnerError(f"launch.ray_address: cannot join the Ray cluster at "
                          f"{launch.ray_address!r}: {exc}{hint}") from None
    return ray


def _use_cluster_token() -> bool:
    """Joining a cluster by its address, send the token when there is one (Ray's default
    since 2.60: ``ray start`` turns token authentication on and writes ~/.ray/auth_token).
    Ray's own client does this only for ``ray`` commands; ``ray.init(address=...)`` would
    connect without it and be refused. An explicit ``RAY_AUTH_MODE`` is left as it is.
    True when the driver sends a token."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    import logging

    try:
        from ray._private.authentication import authentication_token_setup as setup
    except ImportError:  # a Ray without token authentication
        return False
    log = logging.getLogger(setup.__name__)
    level = log.level
    log.setLevel(logging.ERROR)  # not Ray's "token authentication is enabled" notice
    try:
        return setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        log.setLevel(level)


def _role_actors(recipe: Recipe, roles: Sequence[str]) -> int:
    """How many role actors the run has: rollout actors, then one per frozen role of
    ``roles`` (the plan's), then one per reward model."""
    if recipe.launch.placement != "separate":
        return 0
    from runner.launch.ray_roles import frozen_roles, reward_model_actors

    return (recipe.launch.rollout_actors + len(frozen_roles(roles))
            + len(reward_model_actors(recipe, roles)))


def _probe(address: str, timeout_s: float) -> None:
    """Fail at once when nothing listens at ``HOST:PORT`` (Ray itself would retry for minutes)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():  # "auto", "ray://...": Ray resolves it
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise RunnerError(f"launch.ray_address: no Ray cluster answers at {address} "
                          f"({exc.strerror or exc}). Start one (ray start --head ...) or fix "
                          "the address") from None


def _placement(ray: Any, recipe: Recipe, roles: Sequence[str]) -> Any:
    """One placement group: a bundle per rank, then one per role actor."""
    from ray.util.placement_group import placement_group

    launch = recipe.launch
    rank = {"CPU": launch.cpus_per_rank, "GPU": launch.gpus_per_rank}
    bundles = [{k: v for k, v in rank.items() if v}] * launch.num_processes
    actor = {"CPU": launch.cpus_per_role_actor, "GPU": launch.gpus_per_role_actor}
    bundles += [{k: v for k, v in actor.items() if v}] * _role_actors(recipe, roles)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    strategy = "STRICT_PACK" if len(nodes) <= 1 else "PACK"
    group = placement_group(bundles, strategy=strategy)
    try:
        try:
            ray.get(group.ready(), timeout=min(10.0, launch.collective_timeout_s))
        except ray.exceptions.GetTimeoutError:
            print(f"waiting for the Ray cluster to place {len(bundles)} actor(s) {bundles}; it "
                  f"has {ray.cluster_resources()}", file=sys.stderr)
            ray.get(group.ready(), timeout=max(0.0, launch.collective_timeout_s - 10.0))
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RunnerError(
            f"the Ray cluster could not place {len(bundles)} actor(s) ({bundles}) within "
            f"{launch.collective_timeout_s:g} s; it has {ray.cluster_resources()}. Lower "
            "launch.cpus_per_rank / gpus_per_rank, or add nodes") from None
    return group


class _Watch:
    """The running rank tasks and what the driver does with them (signals, failures)."""

    def __init__(self, ray: Any, actors: list[Any], extra: dict[str, Any]) -> None:
        self.ray, self.actors, self.extra = ray, actors, extra
        self.refs: list[Any] = []
        self.signals = 0

    def forward(self, signum: int, frame: object) -> None:
        self.signals += 1
        if not self.refs:  # still setting up: nothing to checkpoint
            raise KeyboardInterrupt
        if self.signals == 1:
            print("stop requested: the ranks finish this step and write a checkpoint "
                  "(press Ctrl-C again to stop at once)", file=sys.stderr)
            # Only the rank tasks' flags: their calls to role actors (a rollout queued behind
            # another rank's) must finish, or one rank fails mid-step while the others wait
            # for it in a collective.
            for ref in self.refs:
                self.ray.cancel(ref, recursive=False)
        else:
            self.kill()

    def kill(self) -> None:
        for actor in [*self.actors, *self.extra.values()]:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)

    def result(self, rank: int) -> tuple[int, str]:
        """(exit code, error lines) of a finished rank; raises naming a rank that died."""
        ray = self.ray
        try:
            return ray.get(self.refs[rank])
        except ray.exceptions.TaskCancelledError:
            return 130, ""
        except ray.exceptions.RayActorError as exc:
            if self.signals >= 2:
                return 130, ""
            raise RunnerError(f"rank {rank}'s actor died ({_first_line(exc)})") from None

    def wait(self) -> int:
        ray = self.ray
        pending = list(range(len(self.refs)))
        codes: dict[int, int] = {}
        while pending:
            ready, _ = ray.wait([self.refs[r] for r in pending], num_returns=1, timeout=POLL_S)
            if not ready:
                continue
            rank = self.refs.index(ready[0])
            pending.remove(rank)
            code, errors = self.result(rank)
            sys.stderr.write(errors)
            codes[rank] = code
            if code in (0, 130):
                continue
            if self.signals >= 2:
                return 130
            deadline = time.monotonic() + GRACE_S  # the others see the broken collective
            while pending and time.monotonic() < deadline:
                done, _ = ray.wait([self.refs[r] for r in pending], num_returns=len(pending),
                                   timeout=POLL_S)
                for ref in done:
                    other = self.refs.index(ref)
                    pending.remove(other)
                    with contextlib.suppress(RunnerError):
                        other_code, other_errors = self.result(other)
                        codes[other] = other_code
                        if other_code == 2:
                            sys.stderr.write(other_errors)
            if code == 2 and all(c == 2 for c in codes.values()) and not pending:
                return 2
            raise RunnerError(f"rank {rank} exited with code {code}; the other ranks were "
                              "stopped. The latest complete checkpoint is intact: run the same "
                              "command again to resume")
        return 130 if 130 in codes.values() or self.signals else 0


class _Stamped:
    """A text stream that remembers when it was last written to (Ray prints the actors' lines
    to ``sys.stdout`` from a thread of its own, some time after they were written)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.at = time.monotonic()

    def write(self, text: str) -> int:
        self.at = time.monotonic()
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _drain(out: _Stamped, quiet_s: float = 1.5, limit_s: float = 6.0) -> None:
    """Wait until the actors' last lines have reached the driver: until nothing was printed
    for ``quiet_s`` (at most ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and time.monotonic() - out.at < quiet_s:
        time.sleep(0.05)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_versions(driver: Mapping[str, str], hellos: Mapping[str, Mapping[str, Any]]) -> None:
    problems = [f"{who} (node {h['ip']}): {', '.join(bad)}" for who, h in hellos.items()
                if (bad := version_mismatches(driver, h["versions"]))]
    if problems:
        raise RunnerError("the actors run other package versions than the driver: "
                          + "; ".join(problems) + ". Install the same versions on every node")


def launch_ray(payload: Payload, recipe: Recipe, plan: RunPlan) -> int:
    """Run the payload's recipe on ``launch.num_processes`` rank actors; the exit code.
    ``plan``: the driver's plan (where the ranks write their checkpoints)."""
    ray = _init_ray(recipe, plan.roles)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    launch, world = recipe.launch, recipe.launch.num_processes
    env = runtime_env(recipe, world)
    group = None
    watch: _Watch | None = None
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stdout = sys.stdout = _Stamped(sys.stdout)
    try:
        group = _placement(ray, recipe, plan.roles)

        def at(bundle: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)

        ranks = [ray.remote(RankActor).options(
            num_cpus=launch.cpus_per_rank, num_gpus=launch.gpus_per_rank, runtime_env=env,
            scheduling_strategy=at(r), max_restarts=0).remote(r, world) for r in range(world)]
        extra: dict[str, Any] = {}
        roles = None
        if launch.placement == "separate":
            from runner.launch.ray_roles import start_role_actors

            extra, roles = start_role_actors(ray, payload, recipe, plan.roles, env, at, world)
        watch = _Watch(ray, ranks, extra)
        for s in old:
            signal.signal(s, watch.forward)
        who = {f"rank {r}": a for r, a in enumerate(ranks)} | extra
        hellos = dict(zip(who, _answers(ray, list(who.values()), "hello", launch, who),
                          strict=True))
        check_versions(package_versions(), hellos)
        if roles is not None:  # errors come back from the first call that needs the model
            for actor in [*roles.rollout, *(a for _, a in roles.frozen + roles.rewards)]:
                actor.build.remote()
        master = ray.get(ranks[0].rendezvous.remote(launch.collective_timeout_s),
                         timeout=launch.collective_timeout_s)
        nodes = [hellos[f"rank {r}"]["node"] for r in range(world)]
        # Ray shows an actor only the GPUs it reserved: its device is cuda:0.
        local = [0] * world if launch.gpus_per_rank else _local_ranks(nodes)
        watch.refs = [a.run.remote(payload, master, local[r], nodes.count(nodes[r]), roles)
                      for r, a in enumerate(ranks)]
        code = watch.wait()
        _drain(stdout)
        if code == 130 and watch.signals == 1:
            _say_stopped(plan)
        return code
    finally:
        sys.stdout = stdout.stream
        if watch is not None:
            watch.kill()
        for s, handler in old.items():
            signal.signal(s, handler)
        if group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)
        ray.shutdown()


def _say_stopped(plan: RunPlan) -> None:
    """After an agreed stop: which checkpoint the ranks wrote (their own lines reach the driver
    through Ray's log stream, which may lag behind the end of the run)."""
    from runner.state.load import latest_checkpoint

    latest = latest_checkpoint(plan.checkpoint_dir)
    if latest is not None:
        print(f"stopped: the checkpoint is written ({latest})", file=sys.stderr)


def _answers(ray: Any, actors: list[Any], method: str, launch: Any, names: Mapping[str, Any]
             ) -> list[Any]:
    """Every actor's answer to ``method``; an actor that cannot start is named."""
    refs = [getattr(a, method).remote() for a in actors]
    out = []
    for name, ref in zip(names, refs, strict=True):
        try:
            out.append(ray.get(ref, timeout=launch.collective_timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise RunnerError(f"{name}'s actor did not start within "
                              f"{launch.collective_timeout_s:g} s") from None
        except ray.exceptions.RayError as exc:
            raise RunnerError(f"{name}'s actor could not start: {_first_line(exc)}") from None
    return out


def _local_ranks(nodes: list[str]) -> list[int]:
    """Each rank's index among the ranks on its node.

    >>> _local_ranks(["a", "b", "a", "b", "a"])
    [0, 0, 1, 1, 2]
    """
    seen: dict[str, int] = {}
    out = []
    for node in nodes:
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return out
