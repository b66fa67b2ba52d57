"""The dispatch table covers every algorithm kind, and runner.algorithms imports only torch."""

import ast
from pathlib import Path

import runner.algorithms as algorithms
from runner.algorithms import dpo, grpo, opd, ppo
from runner.recipe.schema import ALGO_KINDS

ALLOWED_ROOTS = {"__future__", "typing", "collections", "math", "bisect", "attrs", "torch"}
ALLOWED_RUNNER = {"runner.algorithms", "runner.recipe.schema"}


def test_losses_cover_every_algo_kind():
    assert set(algorithms.LOSSES) == set(ALGO_KINDS)
    assert algorithms.LOSSES == {
        "grpo": grpo.grpo_loss,
        "dpo": dpo.dpo_loss,
        "ppo": ppo.ppo_loss,
        "opd": opd.opd_loss,
    }


def test_algorithms_import_only_torch_attrs_and_the_schema():
    bad = []
    for path in Path(algorithms.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.startswith("runner"):
                    ok = any(name == r or name.startswith(r + ".") for r in ALLOWED_RUNNER)
                else:
                    ok = name.split(".")[0] in ALLOWED_ROOTS
                if not ok:
                    bad.append(f"{path.name}: {name}")
    assert bad == []
