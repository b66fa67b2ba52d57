"""What every Ray actor of a run starts with, shared by the rank actors (``ray_backend``) and
the role actors (``ray_roles``): its environment variables and runtime_env, and the hello that
tells the driver its package versions and node."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from runner.recipe.schema import Recipe

# A local cluster is one node: with this setting Ray takes 127.0.0.1 as the node's address and
# binds every server (GCS, raylet, object manager, workers, agents) there instead of on the
# host's other address. It is read when ``ray`` is imported.
LOCAL_CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def package_versions() -> dict[str, str]:
    """Python and the versions of the packages a rank runs, the same list the resolved recipe
    records (absent ones left out)."""
    from runner.recipe.resolved import package_versions as installed

    return {"python": ".".join(map(str, sys.version_info[:3])), **installed()}


def actor_hello() -> dict[str, Any]:
    """What an actor tells the driver at start: versions, process id, node."""
    import ray

    return {"versions": package_versions(), "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


def version_mismatches(driver: Mapping[str, str], actor: Mapping[str, str]) -> list[str]:
    """The packages whose versions differ between the driver and an actor, as 'name X (driver
    Y)'.

    >>> version_mismatches({"torch": "2.13.0", "ray": "2.60.0"},
    ...                    {"torch": "2.12.1", "ray": "2.60.0"})
    ['torch 2.12.1 (driver 2.13.0)']
    >>> version_mismatches({"vllm": "0.32.0"}, {})
    ['vllm missing (driver 0.32.0)']
    """
    return [f"{name} {actor.get(name, 'missing')} (driver {version})"
            for name, version in sorted(driver.items()) if actor.get(name) != version]


def actor_env(recipe: Recipe, world: int) -> dict[str, str]:
    """Environment variables every actor gets (Ray's runtime_env ``env_vars``): the driver's
    thread count (as torchrun's ranks get it, so both give the same numbers), its PYTHONPATH,
    the hub libraries' offline flags, and the local-cluster setting."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))
    env = {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    for name in ("PYTHONPATH", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME",
                 "POSTTRAIN_CACHE", *LOCAL_CLUSTER_ENV):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def runtime_env(recipe: Recipe, world: int) -> dict[str, Any]:
    """The recipe's ``launch.ray_runtime_env`` with this package's ``env_vars`` added (the
    recipe's own ``env_vars`` win)."""
    user = dict(recipe.launch.ray_runtime_env)
    return {**user, "env_vars": {**actor_env(recipe, world), **dict(user.get("env_vars", {}))}}
