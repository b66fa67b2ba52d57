"""Shared fixtures: repository paths and a helper that runs the CLI in-process."""

from __future__ import annotations

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.toml")) + sorted((REPO / "examples").glob("*.toml"))


@pytest.fixture
def repo() -> pathlib.Path:
    return REPO


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run posttrain-run in this process from the repository root; returns (rc, stdout, stderr)."""
    from runner.cli import main

    def _run(*argv: str) -> tuple[int, str, str]:
        monkeypatch.chdir(REPO)
        rc = main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return _run
