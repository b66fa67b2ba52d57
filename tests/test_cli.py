"""posttrain-run from the outside: modes, exit codes, one line per problem, no tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.errors import RecipeError
from runner.recipe import recipe_from_mapping
from tests.conftest import RECIPES, REPO

GRPO = "recipes/grpo-arith.toml"


def cli(*args: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "posttrain-run")
    return subprocess.run([exe, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_validate_manifest_imports_no_torch():
    """What keeps --validate-manifest fast (the benchmark table has its time): no torch, no
    user code."""
    out = cli("--validate-manifest", GRPO)
    assert out.returncode == 0, out.stderr
    assert "recipe is valid" in out.stdout
    code = ("import sys; from runner.cli import main; rc = main(['--validate-manifest', "
            f"{GRPO!r}]); assert 'torch' not in sys.modules; sys.exit(rc)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# recipes that name an earlier stage's run folder: valid once that run exists
CHAINED = {"grpo-rm-arith.toml": ("reward.functions[0]", "runs/rm-arith")}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate(run_cli, path):
    rc, out, err = run_cli("--validate", str(path.relative_to(REPO)))
    if path.name in CHAINED and not (REPO / CHAINED[path.name][1]).exists():
        key, run = CHAINED[path.name]
        assert rc == 2 and err.startswith(f"{path.relative_to(REPO)}: {key}: model folder not "
                                          f"found (got '{run}')."), err
        return
    assert rc == 0, err
    assert "valid" in out


def test_validate_names_missing_factory():
    out = cli("--validate", GRPO, "data.factory=no.such.module.fn")
    assert out.returncode == 2
    assert "data.factory: no.such.module.fn:" in out.stderr
    assert "Traceback" not in out.stderr


def test_validate_checks_factory_kwargs_bind(run_cli):
    rc, _, err = run_cli("--validate", GRPO, "data.factory=tests.extmods.callables.two_kwargs",
                         "data.factory_kwargs.bogus=1")
    assert rc == 2 and "unexpected keyword argument 'bogus'" in err
    rc, _, err = run_cli("--validate", GRPO, "data.factory=tests.extmods.callables.two_kwargs",
                         "data.factory_kwargs.count=1000")
    assert rc == 0, err


def test_validate_reports_every_bad_extension(run_cli):
    rc, _, err = run_cli("--validate", GRPO, "data.items_fn=tests.extmods.callables.nope",
                         "data_packer.factory=tests.extmods.callables.two_kwargs",
                         "reward.functions=[\"arithmetic_exact\", "
                         "\"tests.extmods.callables.NOT_CALLABLE\"]")
    lines = err.strip().splitlines()
    assert rc == 2
    assert any("data.items_fn: tests.extmods.callables.nope" in x for x in lines)
    assert any("reward.functions[1]" in x and "not a callable" in x for x in lines)
    assert len(lines) == 2, lines  # two_kwargs binds with no arguments: a valid zero-arg factory


def test_factory_and_path_exit_2_naming_both():
    out = cli("--validate-manifest", GRPO, "data.factory=a.b", "data.path=x.jsonl")
    assert out.returncode == 2
    assert "data.factory" in out.stderr and "data.path" in out.stderr


def test_unknown_key_exit_2_naming_key_and_table(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[rollout]\nengine = "hf"\ntemprature = 0.7\n')
    out = cli("--validate-manifest", str(recipe))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"{recipe}: rollout.temprature: unknown key in [rollout]. "
                                  "Did you mean 'temperature'?")


def test_missing_file_and_bad_toml(tmp_path):
    out = cli("--validate-manifest", str(tmp_path / "nope.toml"))
    assert out.returncode == 2 and "recipe file not found" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname=1")
    out = cli("--validate-manifest", str(bad))
    assert out.returncode == 2 and "not valid TOML" in out.stderr and "Traceback" not in out.stderr


def test_help_and_version():
    out = cli("--help")
    assert out.returncode == 0 and "--dry-run" in out.stdout and "--validate-manifest" in out.stdout
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("posttrain-run ")


# --- fuzzing: the loader returns a Recipe or raises RecipeError, and the CLI exits 2 ------------

KEYS = ["run", "model", "data", "algo", "rollout", "train", "seed", "kind", "group_size", "lr",
        "factory", "path", "name", "max_steps", "validation", "size", "bogus", "functions"]
scalars = st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True), st.booleans(),
                    st.text(max_size=8), st.sampled_from(["grpo", "dpo", "ppo", "opd", "a.b"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
    max_leaves=12)
documents = st.dictionaries(st.sampled_from(KEYS), values, max_size=5)
override_keys = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4).map(".".join)
overrides = st.lists(st.tuples(st.sampled_from(["", "+"]), override_keys,
                               st.sampled_from(["=", "", "=="]), st.text(max_size=10))
                     .map(lambda t: "".join(t)), max_size=3)


def _is_clean_outcome(doc, ovs) -> RecipeError | None:
    try:
        recipe_from_mapping(doc, source="fuzz.toml", overrides=ovs)
    except RecipeError as exc:
        assert exc.lines() and all(line.strip() for line in exc.lines())
        return exc
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents, overrides)
def test_fuzzed_documents_give_recipe_or_recipe_error(doc, ovs):
    _is_clean_outcome(doc, ovs)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(RECIPES), st.data())
def test_mutated_shipped_recipes(path, data):
    import tomllib

    doc = tomllib.loads(path.read_text())
    table = data.draw(st.sampled_from(sorted(doc)))
    if isinstance(doc[table], dict) and doc[table]:
        key = data.draw(st.sampled_from(sorted(doc[table])))
        doc[table][key] = data.draw(values)
    else:
        doc[table] = data.draw(values)
    _is_clean_outcome(doc, data.draw(overrides))


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(documents.filter(lambda d: _is_clean_outcome(d, ()) is not None))
def test_cli_exits_2_without_traceback_on_fuzzed_recipe(tmp_path_factory, doc):
    import tomli_w

    try:
        text = tomli_w.dumps(doc)
    except (TypeError, ValueError):
        # not representable as TOML (e.g. NaN in some writers): the loader case is covered above
        return
    path = tmp_path_factory.mktemp("fuzz") / "r.toml"
    path.write_text(text)
    import contextlib
    import io

    from runner.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["--validate-manifest", str(path)])
    assert rc == 2
    assert "Traceback" not in err.getvalue() and err.getvalue().strip()
