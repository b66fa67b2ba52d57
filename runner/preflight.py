"""``--validate``: import every dotted path of a recipe and check it can be called as configured;
check the model folders exist and the output folder can be made.

Nothing is constructed here (no dataset, no packer): construction belongs to the owning role.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from runner.errors import ExtensionError, Problem, show_value
from runner.extensions import check_binds, load_callable
from runner.recipe.algos import spec_of
from runner.recipe.checks import BUILTIN_REWARDS, trackers_of
from runner.recipe.plan import sharded_roles
from runner.recipe.reward_names import is_model_reward, model_rewards
from runner.recipe.schema import Recipe
from runner.rewards.model import reward_model_problems


def _calls(recipe: Recipe) -> list[tuple[str, str, tuple | None, dict[str, Any]]]:
    """(key, dotted path, positional args, keyword args) of every configured extension call."""
    d, p = recipe.data, recipe.data_packer
    calls = [
        ("data.factory", d.factory, (), d.factory_kwargs),
        ("data.items_fn", d.items_fn, ({},), {}),
        ("data.validation.factory", d.validation.factory, (), d.validation.factory_kwargs),
        ("data_packer.factory", p.factory, (), {}),
        ("data_packer.teacher_model_factory", p.teacher_model_factory, (), {}),
    ]
    calls += [
        (f"reward.functions[{i}]", fn, ([], []), {})
        for i, fn in enumerate(recipe.reward.functions)
        if fn not in BUILTIN_REWARDS and not is_model_reward(fn)
        and spec_of(recipe).trains_on_rewards
    ]
    e = recipe.env
    calls.append(("env.factory", e.factory, (), e.factory_kwargs))
    calls.append(("env.agent", e.agent, (None,), {"client": None, **e.agent_kwargs}))
    calls += [(f"env.tools[{i}]", tool, None, {}) for i, tool in enumerate(e.tools)]
    return [c for c in calls if c[1]]


def _model_paths(recipe: Recipe) -> list[tuple[str, str]]:
    """(key, path) of every model folder the recipe names."""
    return [("model.path", recipe.model.path)] + [
        (m.key, m.path) for m in spec_of(recipe).models(recipe.algo)]


def check_model_folder(path: str, key: str, trust_remote_code: bool = False) -> list[Problem]:
    """A ``builtin:NAME`` must be a known name (nothing is built); any other path a folder
    holding config.json that transformers reads as the run will: a ``model_type`` it does not
    know, or one whose ``auto_map`` code is not trusted, is the run's own problem. The folder's
    code never runs here (a trusted ``auto_map`` is left to the run)."""
    from runner.errors import RecipeError
    from runner.models import read_model_type, resolve_model_path
    from runner.models.loading import check_config

    try:
        if path.startswith("builtin:"):
            read_model_type(path, key=key)  # answers from the table; unknown names raise
        else:
            folder = resolve_model_path(path, key=key)
            if not trust_remote_code:
                check_config(folder, key=key)
    except RecipeError as exc:
        return list(exc.problems)
    return []


def check_output_dir(output_dir: str, key: str = "run.output_dir") -> list[Problem]:
    """The output folder exists as a writable folder, or can be made: its deepest existing
    ancestor must be a folder in which a folder can be made (tried with a temporary one, removed
    at once; nothing else is created)."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        return [Problem(key, "exists and is not a folder", got=output_dir,
                        hint="choose a folder path for the run's outputs")]
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return [Problem(key, f"cannot be made: {ancestor} is not a folder", got=output_dir,
                        hint="choose a folder path for the run's outputs")]
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".posttrain-probe-", dir=ancestor))
    except OSError as exc:
        return [Problem(key, f"cannot be made: no folder can be created in {ancestor} "
                        f"({exc.strerror or exc})", got=output_dir,
                        hint="choose a writable location for run.output_dir")]
    return []


# tracker -> (the module it imports, the extra of this project that installs it)
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow")}


def validate_trackers(recipe: Recipe) -> list[Problem]:
    """Every tracker the recipe reports to has its library installed (found, not imported)."""
    problems = []
    listed = recipe.logging.report_to
    for name in trackers_of(recipe.logging):
        module, extra = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is not None:
            continue
        key, drop = "logging.report_to", f"remove {name!r} from logging.report_to"
        if name not in listed:  # only the deprecated flag asks for it
            key, drop = "logging.tensorboard", "set logging.tensorboard = false"
        problems.append(Problem(key, f"{name!r} needs the {module} package, which is not "
                                "installed", got=listed if name in listed else True,
                                hint=f"pip install -e '.[{extra}]' (make setup installs it), "
                                f"or {drop}"))
    return problems


def validate_compiler(recipe: Recipe) -> list[Problem]:
    """``train.compile`` on a CPU: torch.compile writes C++ kernels, so a C++ compiler must be
    there (found as torch's inductor looks for one: ``CXX``, else g++)."""
    from runner.precision import device_type

    if not recipe.train.compile or device_type(recipe) != "cpu":
        return []
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return [Problem("train.compile", "torch.compile needs a C++ compiler to build CPU "
                        "kernels and none was found (tried $CXX, then g++)", got=True,
                        hint="install g++ (or point CXX at a C++ compiler), or set "
                        "train.compile = false")]
    return []


def validate_models(recipe: Recipe) -> list[Problem]:
    """Checks that need the local file system: every model folder exists (built-in names are
    known), the output folder can be made, and OPD same_tokenizer has one vocabulary for
    student and teacher (built-in models are built once for that, then cached)."""
    trust = recipe.model.trust_remote_code
    problems = [p for key, path in _model_paths(recipe)
                for p in check_model_folder(path, key, trust)]
    problems += [p for key, path in model_rewards(recipe.reward.functions)
                 for p in reward_model_problems(path, key)]
    problems += check_output_dir(recipe.run.output_dir)
    shared = [m for m in spec_of(recipe).models(recipe.algo) if m.same_vocab]
    if problems or not shared:
        return problems
    from runner.errors import RecipeError
    from runner.models import resolve_model_path
    from runner.models.vocab import check_same_vocab

    try:
        for m in shared:
            check_same_vocab(resolve_model_path(recipe.model.path), resolve_model_path(m.path),
                             trust_remote_code=recipe.model.trust_remote_code)
    except RecipeError as exc:
        return list(exc.problems)
    return []


def validate_extensions(recipe: Recipe, overrides: Sequence[str] = ()) -> list[Problem]:
    """Every problem with the recipe's extensions (all are checked, none stops the others).

    ``overrides``: the command line's KEY=VALUE items; a factory given there whose kwargs do not
    bind is told that its ``*_kwargs`` table came from the recipe, and how to replace it.
    """
    problems: list[Problem] = []
    given = _override_keys(overrides)
    for key, dotted, args, kwargs in _calls(recipe):
        try:
            fn: Callable[..., Any] = load_callable(dotted, key=key)
        except ExtensionError as exc:
            problems += exc.problems
            continue
        if args is None:  # imported only (a tool's arguments come from the model)
            continue
        try:
            check_binds(fn, dotted, key=key, args=args, kwargs=kwargs)
        except ExtensionError as exc:
            problems += [_kwargs_from_recipe(p, key, kwargs, given) for p in exc.problems]
    return problems


def _override_keys(overrides: Sequence[str]) -> set[str]:
    from runner.recipe.load import parse_overrides

    return {ov.key for ov in parse_overrides(overrides)[0]}


def _kwargs_from_recipe(problem: Problem, key: str, kwargs: dict[str, Any],
                        given: set[str]) -> Problem:
    """``problem`` with a hint saying where the kwargs came from, when ``key`` (a factory) was
    overridden on the command line but its kwargs table was not."""
    table = f"{key}_kwargs"
    if not kwargs or key not in given or any(k == table or k.startswith(table + ".")
                                             for k in given):
        return problem
    hint = (f"{problem.hint}. {table} = {show_value(kwargs)} came from the recipe (written for "
            f"its own {key}), not from the command line: replace the whole table on the command "
            f"line too, {table}={{...}} with the new factory's arguments, or {table}={{}} for none")
    return attrs.evolve(problem, hint=hint)


@attrs.frozen
class StateEstimate:
    """Per rank, the bytes of every model's state (``runner.models.memory``) in the layout a
    run of the recipe uses (``layout``) and in the other; the device's memory where it
    reports it."""

    layout: str  # "DDP" (every rank a full copy) or "FSDP" (sharded over the ranks)
    world: int
    full: dict[str, Any]  # role -> StateBytes with every rank holding a full copy
    device_bytes: int | None
    device: str
    sharded_roles: tuple[str, ...]  # the roles fsdp shards (runner.recipe.plan.sharded_roles)
    actors: dict[str, Any] = attrs.Factory(dict)  # role -> StateBytes, each in a Ray actor

    def part(self, role: str, sharded: bool) -> Any:
        """A role's bytes per rank: FSDP shards the roles of ``sharded_roles``
        (runner.recipe.plan.sharded_roles); the others stay whole on every rank."""
        s = self.full[role]
        return s.sharded(self.world) if sharded and role in self.sharded_roles else s

    def per_rank(self, sharded: bool) -> int:
        return sum(self.part(role, sharded).total for role in self.full)

    def rows(self) -> list[tuple[str, str]]:
        from runner.models.memory import gib

        def line(sharded: bool) -> str:
            parts = [f"{role} {gib(self.part(role, sharded).total)}" for role in self.full]
            return f"{gib(self.per_rank(sharded))} ({', '.join(parts)})"

        policy = self.full["policy"]
        rows = [("policy state (full copy)", f"parameters {gib(policy.params)} + gradients "
                 f"{gib(policy.grads)} + AdamW {gib(policy.optimizer)}"),
                ("model state per rank, DDP", line(False) + (" <- this run" if self.layout ==
                                                               "DDP" else "")),
                (f"model state per rank, FSDP over {self.world}",
                 line(True) + (" <- this run" if self.layout == "FSDP" else ""))]
        if self.actors:
            rows.append(("in role actors of their own", ", ".join(
                f"{role} {gib(s.total)}" for role, s in self.actors.items())))
        memory = (f"{gib(self.device_bytes)} ({self.device})" if self.device_bytes
                  else f"not reported ({self.device}): not checked")
        return rows + [("device memory", memory)]

    def problems(self) -> list[Problem]:
        """The layout's estimate over the device's memory: refused, naming the keys to change."""
        need = self.per_rank(self.layout == "FSDP")
        if not self.device_bytes or need <= self.device_bytes:
            return []
        from runner.models.memory import gib

        return [Problem("launch.num_processes", f"the model state alone needs about {gib(need)} "
                        f"per rank ({self.layout} over {self.world} rank(s)), more than the "
                        f"{gib(self.device_bytes)} of {self.device}", got=self.world,
                        hint="shard the policy (train.sharding = 'fsdp') over more ranks "
                        "(launch.num_processes), train adapters (model.lora.rank), or use a "
                        "smaller model (model.path)")]


def estimate_state(recipe: Recipe, world: int) -> StateEstimate:
    """The per-rank state of the models a run of ``recipe`` on ``world`` ranks builds, from
    their folders' safetensors headers (nothing is loaded)."""
    from runner.models import resolve_model_path
    from runner.models.memory import (
        DTYPE_BYTES,
        count,
        frozen_bytes,
        lora_count,
        tensor_shapes,
        trained_bytes,
    )
    from runner.precision import resolve
    from runner.recipe.plan import planned_roles

    roles = planned_roles(recipe)
    m = recipe.model
    dtype = DTYPE_BYTES[m.dtype]
    frozen_dtype = 2 if resolve(recipe).train == "bf16" else dtype
    shapes = tensor_shapes(resolve_model_path(m.path))
    n = count(shapes)
    trained = lora_count(shapes, m.lora.rank, m.lora.target_modules) if m.lora.rank else n
    full: dict[str, Any] = {"policy": trained_bytes(n, trained, dtype)}
    refs = {m.role: m for m in spec_of(recipe).models(recipe.algo)}

    def params(role: str) -> int:  # a model of its own folder, or a copy of the policy
        ref = refs.get(role)
        return count(tensor_shapes(resolve_model_path(ref.path, key=ref.key))) if ref else n

    if "critic" in roles:
        full["critic"] = trained_bytes(params("critic"), params("critic"), dtype)
    # Under Ray's separate placement the frozen models live in role actors of their own.
    on_ranks = not (recipe.launch.backend == "ray" and recipe.launch.placement == "separate")
    frozen: dict[str, Any] = {}
    if "reference" in roles:
        frozen["reference"] = frozen_bytes(n, frozen_dtype)
    if "teacher" in roles:
        frozen["teacher"] = frozen_bytes(params("teacher"), frozen_dtype)
    for i, (key, path) in enumerate(model_rewards(recipe.reward.functions)
                                    if "reward" in roles else []):
        name = "reward model" + (f" {i + 1}" if i else "")
        frozen[name] = frozen_bytes(count(tensor_shapes(resolve_model_path(path, key=key))), dtype)
    if on_ranks:
        full |= frozen
    device_bytes, device = device_memory(recipe)
    layout = "FSDP" if recipe.train.sharding == "fsdp" else "DDP"
    return StateEstimate(layout, world, full, device_bytes, device, sharded_roles(recipe),
                         {} if on_ranks else frozen)


def device_memory(recipe: Recipe) -> tuple[int | None, str]:
    """(the bytes of the run's device where it reports them, its name): a CUDA GPU's total
    memory; None on a CPU."""
    from runner.precision import device_type

    device = device_type(recipe)
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return (torch.cuda.get_device_properties(0).total_memory,
                    f"cuda:0, {torch.cuda.get_device_name(0)}")
    return None, device


def state_problems(recipe: Recipe, world: int) -> list[Problem]:
    """The run's layout refused when its model state exceeds the device's memory; nothing is
    estimated where the device reports no memory (a CPU)."""
    if device_memory(recipe)[0] is None:
        return []
    return estimate_state(recipe, world).problems()
