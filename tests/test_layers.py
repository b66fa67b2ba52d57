"""Imports between the parts of ``runner`` point one way.

A part is a top-level subpackage (``runner/train/``) or a top-level module (``runner/errors.py``).
Every import of every file counts, also one made inside a function (a lazy import ties the
parts as much as one at the top) and ``importlib.import_module("runner....")`` with a literal
name. No two parts may import each other; a top-level module such as ``runner/errors.py`` may
be imported by every part as long as it imports none of them back.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "runner"


def part_of(module: str) -> str | None:
    """The part of ``runner`` a dotted module name belongs to (None: outside the package).

    >>> (part_of("runner.train.loops.grpo"), part_of("runner.errors"), part_of("runner"),
    ...  part_of("torch"))
    ('train', 'errors', '__init__', None)
    """
    names = module.split(".")
    if names[0] != "runner":
        return None
    return names[1] if len(names) > 1 else "__init__"


def imported_modules(file: Path) -> list[tuple[str, int]]:
    """(dotted module name, line) of every import in ``file``, wherever it stands."""
    relative = file.relative_to(REPO).with_suffix("").parts
    package = relative[:-1]  # an __init__.py is its own package; a module's is its folder
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), filename=str(file))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # ``from runner import cli`` imports the module runner.cli, not a name of runner
            out += [(f"{module}.{alias.name}" if module == "runner" else module, node.lineno)
                    for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id",
              None)) == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, node.lineno))
    return out


def part_imports() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> the places ("runner/x/y.py:12") that import so."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for file in sorted(PACKAGE.rglob("*.py")):
        me = part_of(".".join(file.relative_to(REPO).with_suffix("").parts))
        for module, line in imported_modules(file):
            other = part_of(module)
            where = f"{file.relative_to(REPO)}:{line}"
            if other is not None and other != me and where not in edges[me, other]:
                edges[me, other].append(where)
    return edges


def test_no_two_parts_of_the_package_import_each_other():
    edges = part_imports()
    pairs = sorted((a, b) for a, b in edges if a < b and (b, a) in edges)
    assert not pairs, "parts of runner that import each other:\n" + "\n".join(
        f"  {a} <-> {b}: {a} -> {b} at {', '.join(edges[a, b])}; "
        f"{b} -> {a} at {', '.join(edges[b, a])}" for a, b in pairs)


def test_no_part_reaches_itself_through_others():
    """Longer circles too (data -> rollout -> packers -> data): the parts form layers."""
    edges = part_imports()
    after: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        after[a].add(b)

    def path_back(start: str) -> list[str] | None:
        stack = [[start]]
        seen: set[str] = set()
        while stack:
            path = stack.pop()
            for nxt in sorted(after[path[-1]]):
                if nxt == start:
                    return path + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(path + [nxt])
        return None

    circles = [p for p in map(path_back, sorted(after)) if p]
    assert not circles, "parts of runner in a circle of imports:\n" + "\n".join(
        "  " + " -> ".join(f"{a} ({edges[a, b][0]})" for a, b in zip(c, c[1:], strict=False))
        for c in circles)


def test_nothing_in_the_package_imports_the_cli():
    edges = part_imports()
    assert not [where for (a, b), where in edges.items() if b == "cli"], edges


def test_the_reader_sees_lazy_relative_and_importlib_imports(tmp_path, monkeypatch):
    folder = tmp_path / "runner" / "train"
    folder.mkdir(parents=True)
    source = folder / "x.py"
    source.write_text("import importlib\n"
                      "def f():\n    from runner.launch import rank\n"
                      "from ..ranks import context\n"
                      "from runner import cli\n"
                      "importlib.import_module('runner.ui.quiet')\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert sorted((line, part_of(m)) for m, line in imported_modules(source)) == [
        (1, None), (3, "launch"), (4, "ranks"), (5, "cli"), (6, "ui")]
