"""The algorithm registry: one row per ``[algo] kind``, each an ``AlgoSpec`` (``spec.py``).

Code outside this package and ``runner.recipe.schema`` never tests an algorithm's kind; it asks
the spec (``spec_of(recipe)``). ``tests/test_layers.py`` holds that rule.
"""

from __future__ import annotations

from runner.recipe.algos import dpo, grpo, opd, ppo, rm, sft
from runner.recipe.algos.spec import AlgoSpec, ModelRef, Shape
from runner.recipe.schema import ALGO_KINDS, Recipe

# kind -> its spec; the order is the order help texts list the kinds in
ALGORITHMS: dict[str, AlgoSpec] = {
    "grpo": grpo.SPEC,
    "dpo": dpo.SPEC,
    "ppo": ppo.SPEC,
    "opd": opd.SPEC,
    "sft": sft.SPEC,
    "rm": rm.SPEC,
}
assert {k: s.config for k, s in ALGORITHMS.items()} == ALGO_KINDS, "a kind without its spec"


def spec_of(recipe: Recipe) -> AlgoSpec:
    """The spec of ``recipe``'s algorithm."""
    return ALGORITHMS[recipe.algo.kind]


def titles(pick) -> str:
    """The titles of the specs ``pick`` accepts, as a sentence lists them ("PPO, GRPO and OPD")."""
    names = [s.title for s in ALGORITHMS.values() if pick(s)]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


__all__ = ["ALGORITHMS", "AlgoSpec", "ModelRef", "Shape", "spec_of", "titles"]
