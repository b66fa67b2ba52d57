"""Recipe values no run can use are refused at --validate-manifest, and every message a user
value reaches stays one escaped, bounded line."""

from __future__ import annotations

import pytest

from runner.errors import Problem, RecipeError, safe_line, show_value
from runner.recipe import load_recipe, recipe_from_mapping
from runner.recipe.checks import MAX_ITEMS, _lookup

GRPO = "recipes/grpo-arith.toml"


def _problems(*overrides: str, raw: dict | None = None) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe_from_mapping(raw or {}, source="r.toml", overrides=overrides)
    return info.value.lines()


@pytest.mark.parametrize("text,got", [("inf", "inf"), ("-inf", "-inf"), ("nan", "nan")])
def test_non_finite_floats_are_refused(text, got):
    assert _problems(f"train.lr={text}") == [
        f"command line: train.lr: must be a finite number (got {got}). "
        "Inf and nan are not usable values."]


def test_non_finite_floats_in_lists_and_free_form_tables_are_refused():
    lines = _problems(raw={"reward": {"functions": ["format"], "weights": [float("nan")]},
                           "data": {"factory_kwargs": {"a": {"b": [1.0, float("inf")]}}}})
    assert lines == [
        "r.toml: data.factory_kwargs.a.b[1]: must be a finite number (got inf). "
        "Inf and nan are not usable values.",
        "r.toml: reward.weights[0]: must be a finite number (got nan). "
        "Inf and nan are not usable values."]


def test_seed_beyond_64_bits_is_refused():
    assert _problems(f"run.seed={10**30}") == [
        "command line: run.seed: is outside the 64-bit integer range (-2**63 to 2**63 - 1) "
        f"(got {10**30})."]
    recipe = recipe_from_mapping({}, overrides=[f"run.seed={2**63 - 1}"])
    assert recipe.run.seed == 2**63 - 1


def test_counts_are_bounded():
    assert _problems("data.count=10000000000", "data.validation.size=2000000") == [
        "command line: data.count: must be at most 1,000,000 (got 10000000000).",
        "command line: data.validation.size: must be at most 1,000,000 (got 2000000)."]
    assert recipe_from_mapping({}, overrides=[f"data.count={MAX_ITEMS}"]).data.count == MAX_ITEMS


def test_arithmetic_pool_is_bounded():
    assert _problems("data.max_operand=100000") == [
        "command line: data.max_operand: the built-in arithmetic pool (max_operand - "
        "min_operand + 1)**2 x len(operators) must be at most 1,000,000 (got 100000). "
        "Narrow the operand range."]


TIMEOUTS = ("reward.timeout_s", "env.step_timeout_s", "env.tool_timeout_s",
            "launch.collective_timeout_s")


@pytest.mark.parametrize("key", TIMEOUTS)
def test_timeouts_are_bounded(key):
    """1e300 s would overflow the thread joins and the collectives' timedelta."""
    assert _problems(f"{key}=1e300") == [
        f"command line: {key}: must be at most 604,800 seconds (a week) (got 1e+300)."]
    assert _lookup(recipe_from_mapping({}, overrides=[f"{key}=604800"]), key) == 604800


def test_max_off_policy_steps_is_bounded():
    for kind in ("grpo", "ppo", "opd"):
        raw = {"algo": {"kind": kind, "max_off_policy_steps": 10**9}}
        assert _problems(raw=raw) == [
            "r.toml: algo.max_off_policy_steps: must be at most 32 (got 1000000000)."]
    recipe = recipe_from_mapping({}, overrides=["algo.max_off_policy_steps=32"])
    assert recipe.algo.max_off_policy_steps == 32


def test_a_timeout_beyond_the_bound_exits_2_in_one_line(run_cli):
    rc, out, err = run_cli("--validate-manifest", GRPO, "env.tool_timeout_s=1e300",
                           "algo.max_off_policy_steps=300")
    assert rc == 2, (out, err)
    assert err.strip().splitlines() == [
        "command line: algo.max_off_policy_steps: must be at most 32 (got 300).",
        "command line: env.tool_timeout_s: must be at most 604,800 seconds (a week) (got "
        "1e+300)."], err


def test_float_for_a_count_is_a_type_error():
    assert _problems("data.validation.size=1e24") == [
        "command line: data.validation.size: expected an integer (got 1e+24)."]


def test_integer_longer_than_the_conversion_limit_in_an_override():
    assert _problems("run.seed=" + "9" * 5000) == [
        "command line: run.seed: the value holds an integer too long to read (more than 4300 "
        "digits). Give a plain TOML value."]


def test_hex_literal_beyond_the_limit_is_shown_by_its_size():
    assert _problems("run.name=0x" + "f" * 4000) == [
        "command line: run.name: expected a string (got an integer of about 4817 digits)."]


def test_deep_nesting_in_an_override_and_a_free_form_table():
    assert _problems("data.factory_kwargs.x=" + "[" * 600 + "]" * 600) == [
        "command line: data.factory_kwargs.x: the value is nested too deeply to read. "
        "Give a plain TOML value."]
    lines = _problems("data.factory_kwargs.x=" + "[" * 40 + "]" * 40)
    assert lines == ["command line: data.factory_kwargs.x" + "[0]" * 32
                     + ": is nested more than 32 levels deep."]


def _recipe_file(tmp_path, data: bytes):
    path = tmp_path / "r.toml"
    path.write_bytes(data)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    return [line.replace(str(path), "R") for line in info.value.lines()]


def test_huge_integer_and_deep_nesting_in_a_file(tmp_path):
    assert _recipe_file(tmp_path, b"[run]\nseed = " + b"7" * 5000 + b"\n") == [
        "R: the recipe holds an integer too long to read (more than 4300 digits). "
        "Give plain TOML values."]
    assert _recipe_file(tmp_path, b"x = " + b"[" * 800 + b"]" * 800 + b"\n") == [
        "R: the recipe is nested too deeply to read. Give plain TOML values."]


def test_invalid_utf8_in_a_recipe_names_the_line(tmp_path):
    assert _recipe_file(tmp_path, b"[run]\nname = 'a'\nseed = 1 # \xff\n") == [
        "R: line 3: not valid UTF-8 (invalid start byte). Save the recipe as UTF-8."]


def test_user_text_is_escaped_and_cut():
    lines = _problems("run.na\nme\x1b[2J=1")
    assert lines == ["command line: run.na\\x0ame\\x1b[2J: unknown key 'na\\nme\\x1b[2J' in "
                     "override. Did you mean 'name'?"]
    line = Problem("k" * 500, "bad", got="v\u2028" * 100).render("src")
    got = ("'" + "v\\u2028" * 100)[:77] + "..."
    assert line == "src: " + "k" * 117 + "...: bad (got " + got + ")."
    assert safe_line("a\udcffb") == "a\\udcffb"
    assert show_value([[[[1]]]]) == "[[[[...]]]]"
    assert show_value(-(10**400)) == "-an integer of about 401 digits"


def test_validate_manifest_line_is_escaped(run_cli, tmp_path):
    weird = tmp_path / "a\x1b[31mb.toml"
    weird.write_text("")
    rc, out, err = run_cli("--validate-manifest", str(weird))
    assert rc == 0, err
    assert out.endswith("a\\x1b[31mb.toml: recipe is valid (grpo, 100 steps)\n")
