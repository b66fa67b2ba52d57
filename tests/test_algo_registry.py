"""One spec per algorithm: ``runner.recipe.algos.ALGORITHMS`` is the only place (with the config
classes of ``runner/recipe/algo_configs.py``) that knows an algorithm by its kind.

Everything else asks the spec. A branch on the kind anywhere else (``algo.kind == "dpo"``, a
kind string in a comparison or as a dict key, ``isinstance(algo, DPOConfig)`` outside an
``assert`` that narrows a loop's own config) fails ``test_no_code_outside_the_registry_branches_
on_a_kind``, naming the place.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import attrs
import pytest

from runner.recipe import load_recipe
from runner.recipe.algos import ALGORITHMS, spec_of
from runner.recipe.plan import make_plan, planned_roles
from runner.recipe.schema import ALGO_KINDS, DEFAULT_KIND, Recipe
from tests.conftest import RECIPES, REPO

KINDS = frozenset(ALGO_KINDS)
CONFIG_NAMES = frozenset(cls.__name__ for cls in ALGO_KINDS.values())
# The registry's package and the algorithm config classes' module may name kinds.
ALLOWED = ("runner/recipe/algos/", "runner/recipe/algo_configs.py")


def _names_kind(node: ast.AST) -> bool:
    """``x.kind`` of something algorithm-like, or a name ``algo_kind`` / ``kind``."""
    if isinstance(node, ast.Attribute) and node.attr == "kind":
        inner = node.value
        return isinstance(inner, ast.Attribute | ast.Name) and "algo" in ast.unparse(inner)
    return isinstance(node, ast.Name) and node.id in ("algo_kind",)


def _kind_constants(node: ast.AST) -> list[str]:
    """Kind strings written in ``node`` (a constant, or a tuple/list/set of constants)."""
    values = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [v.value for v in values if isinstance(v, ast.Constant) and v.value in KINDS]


def kind_branches(source: str) -> list[tuple[int, str]]:
    """(line, code) of every place in ``source`` that tells algorithms apart by their kind."""
    tree = ast.parse(source)
    asserted = {id(n.test) for n in ast.walk(tree) if isinstance(n, ast.Assert)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            hit = any(_kind_constants(s) for s in sides) or any(_names_kind(s) for s in sides)
        elif isinstance(node, ast.Dict):  # a table keyed by kinds: every string key is a kind
            keys = [k.value for k in node.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            hit = bool(keys) and all(k in KINDS for k in keys)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "isinstance" and len(node.args) == 2
              and id(node) not in asserted):
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            hit = bool(named & CONFIG_NAMES)
        elif isinstance(node, ast.Subscript) and _names_kind(node.slice):
            # TABLE[recipe.algo.kind]: a table keyed by kind, unless it is the registry itself
            hit = not ast.unparse(node.value).endswith("ALGORITHMS")
        if hit:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_detector_finds_each_way_of_branching_on_a_kind():
    planted = '\n'.join([
        'if recipe.algo.kind == "dpo": pass',
        'if r.algo.kind in ("grpo", "ppo"): pass',
        'x = "opd" != kind_name',
        'OPEN = {"grpo": 1}',
        'ok = isinstance(a, (PPOConfig, GRPOConfig))',
        'loop = LOOPS[recipe.algo.kind]',
        'need = algo_kind == other',
    ])
    assert [line for line, _ in kind_branches(planted)] == [1, 2, 3, 4, 5, 6, 7]
    # a table of other names, one of which is spelled like a kind, is not keyed by kind
    assert kind_branches('ESTIMATORS = {"grpo": 1, "rloo": 2}') == []
    clean = '\n'.join([
        'assert isinstance(algo, GRPOConfig)',  # a loop narrowing its own config
        'print(recipe.algo.kind)',  # naming the kind in a message is not a branch
        'spec = ALGORITHMS[algo_kind]',  # the registry's own lookup
        'if spec_of(recipe).stream == "pairs": pass',
        'if p.kind in (p.VAR_POSITIONAL,): pass',  # another kind (inspect's)
    ])
    assert kind_branches(clean) == []


def test_no_code_outside_the_registry_branches_on_a_kind():
    offenders = []
    for file in sorted((REPO / "runner").rglob("*.py")):
        rel = file.relative_to(REPO).as_posix()
        if rel.startswith(ALLOWED):
            continue
        offenders += [f"{rel}:{line}: {code}"
                      for line, code in kind_branches(file.read_text(encoding="utf-8"))]
    assert offenders == [], "ask runner.recipe.algos.spec_of(recipe) instead:\n" + "\n".join(
        offenders)


def test_every_kind_has_one_complete_spec():
    assert set(ALGORITHMS) == KINDS and DEFAULT_KIND in KINDS
    recipe_keys = {f"data.{f.name}" for f in attrs.fields(type(Recipe().data))}
    recipe_keys |= {f"data.validation.{f.name}"
                    for f in attrs.fields(type(Recipe().data.validation))}
    recipe_keys |= {f"data_packer.{f.name}" for f in attrs.fields(type(Recipe().data_packer))}
    for kind, spec in ALGORITHMS.items():
        assert spec.kind == kind and ALGO_KINDS[kind] is spec.config
        config = spec.config()
        assert spec.batch_key.removeprefix("algo.") in attrs.fields_dict(spec.config), kind
        assert spec.items_per_step(config) == spec.shape(config).items
        assert spec.stream in ("prompts", "pairs", "conversations")
        assert set(spec.owned_keys) <= recipe_keys, kind
        assert callable(importlib.import_module(spec.loop).run), kind


@pytest.mark.parametrize("path", [p for p in RECIPES if "smollm2" not in p.name],
                         ids=lambda p: p.name)
def test_the_plan_of_every_shipped_recipe_is_what_its_spec_says(path: Path):
    recipe = load_recipe(path, [])
    spec, plan = spec_of(recipe), make_plan(recipe)
    shape = spec.shape(recipe.algo)
    assert (plan.items_per_step, plan.samples_per_step) == (shape.items, shape.samples)
    assert plan.optimizer_steps_per_step == shape.passes * shape.splits
    assert set(planned_roles(recipe)) == {"driver", "policy"} | spec.roles(recipe)
    assert plan.samples_online == spec.samples_online


def test_the_shapes_by_hand():
    """A step's sizes for each kind, derived by hand from the keys."""
    grpo = ALGORITHMS["grpo"].config(prompts_per_step=4, group_size=3, ppo_epochs=2, minibatches=6)
    assert attrs.astuple(ALGORITHMS["grpo"].shape(grpo)) == (4, 12, 2, 6)
    ppo = ALGORITHMS["ppo"].config(prompts_per_step=5, samples_per_prompt=2, ppo_epochs=3,
                                   minibatches=5)
    assert attrs.astuple(ALGORITHMS["ppo"].shape(ppo)) == (5, 10, 3, 5)
    opd = ALGORITHMS["opd"].config(prompts_per_step=6, samples_per_prompt=4, ppo_epochs=2)
    assert attrs.astuple(ALGORITHMS["opd"].shape(opd)) == (6, 24, 2, 1)
    dpo = ALGORITHMS["dpo"].config(pairs_per_step=7)
    assert attrs.astuple(ALGORITHMS["dpo"].shape(dpo)) == (7, 14, 1, 1)
    sft = ALGORITHMS["sft"].config(examples_per_step=9)
    assert attrs.astuple(ALGORITHMS["sft"].shape(sft)) == (9, 9, 1, 1)
    rm = ALGORITHMS["rm"].config(pairs_per_step=5)
    assert attrs.astuple(ALGORITHMS["rm"].shape(rm)) == (5, 10, 1, 1)
