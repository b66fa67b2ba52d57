"""runner.algorithms is pure tensor math: it imports only torch, attrs and the schema."""

import ast
from pathlib import Path

import runner.algorithms as algorithms

ALLOWED_ROOTS = {"__future__", "typing", "collections", "math", "bisect", "attrs", "torch"}
ALLOWED_RUNNER = {"runner.algorithms", "runner.recipe.schema"}


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
