"""The recipe model: parsing, defaults, type errors, overrides, cross-field rules, round trip."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runner.errors import RecipeError
from runner.recipe import load_recipe, recipe_from_mapping
from runner.recipe.load import parse_value
from runner.recipe.resolved import recipe_hash, write_resolved
from runner.recipe.schema import DPOConfig, GRPOConfig, OPDConfig, PPOConfig, Recipe, RMConfig
from tests.conftest import RECIPES


def problems_of(raw: dict, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe_from_mapping(raw, source="r.toml", overrides=overrides)
    return info.value.lines()


def one_problem(raw: dict, overrides: tuple[str, ...] = ()) -> str:
    lines = problems_of(raw, overrides)
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_parse(path):
    recipe = load_recipe(path)
    assert recipe.run.name == path.stem
    assert path.read_text().startswith("#:schema ../schemas/recipe.schema.json")


def test_empty_recipe_is_all_defaults():
    recipe = recipe_from_mapping({})
    assert recipe == Recipe()
    assert isinstance(recipe.algo, GRPOConfig) and recipe.algo.group_size == 8


@pytest.mark.parametrize("kind,cls", [("grpo", GRPOConfig), ("dpo", DPOConfig),
                                      ("ppo", PPOConfig), ("opd", OPDConfig),
                                      ("rm", RMConfig)])
def test_algo_is_tagged_union(kind, cls):
    assert isinstance(recipe_from_mapping({"algo": {"kind": kind}}).algo, cls)


def test_recipe_is_frozen():
    import attrs

    recipe = Recipe()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        recipe.run.seed = 3  # type: ignore[misc]


def test_unknown_key_names_key_and_table():
    line = one_problem({"run": {"sed": 1}})
    assert line.startswith("r.toml: run.sed: unknown key in [run]")
    assert "Did you mean 'seed'" in line


def test_unknown_key_in_algo_names_kind():
    line = one_problem({"algo": {"kind": "dpo", "group_size": 4}})
    assert "algo.group_size: unknown key in [algo] for kind = 'dpo'" in line


def test_unknown_table():
    assert "bogus: unknown key in the recipe" in one_problem({"bogus": {}})


def test_unknown_kind_lists_valid_kinds():
    line = one_problem({"algo": {"kind": "kto"}})
    assert "algo.kind: unknown algorithm kind (got 'kto')" in line
    assert "grpo, dpo, ppo, opd, sft, rm" in line


def test_wrong_type_names_expected_and_received():
    assert "run.seed: expected an integer (got 'seven')" in one_problem({"run": {"seed": "seven"}})
    assert ("algo.group_size: expected an integer (got True)"
            in one_problem({"algo": {"group_size": True}}))
    assert "train.lr: expected a number (got '1e-3')" in one_problem({"train": {"lr": "1e-3"}})
    assert ("data.operators[1]: expected a string (got 3)"
            in one_problem({"data": {"operators": ["+", 3]}}))
    assert "reward: expected a table (got 5)" in one_problem({"reward": 5})


def test_literal_lists_choices():
    line = one_problem({"data": {"cursor_resume": "maybe"}})
    assert "data.cursor_resume: not a valid choice (got 'maybe')" in line
    assert "'strict', 'auto', 'off'" in line


def test_all_problems_reported_together():
    lines = problems_of({"run": {"seed": "x", "bogus": 1}, "train": {"lr": "y"},
                         "data": {"validation": {"size": 1.5}}})
    keys = sorted(line.split(": ")[1] for line in lines)
    assert keys == ["data.validation.size", "run.bogus", "run.seed", "train.lr"]


# --- cross-field rules ---------------------------------------------------------------------

def test_data_sources_mutually_exclusive():
    line = one_problem({"data": {"factory": "a.b", "path": "x.jsonl"}})
    assert "data.factory and data.path are mutually exclusive" in line


def test_dpo_factory_with_builtin_source():
    line = one_problem({"algo": {"kind": "dpo"}, "data": {"factory": "a.b", "synthetic_pairs": 10}})
    assert line.startswith("r.toml: data.factory:") and "data.synthetic_pairs" in line
    line = one_problem({"algo": {"kind": "dpo"},
                        "data": {"factory": "a.b", "jsonl_path": "p.jsonl"}})
    assert "data.jsonl_path" in line
    line = one_problem({"algo": {"kind": "dpo"}, "data": {"factory": "a.b", "tar_path": "p.tar"}})
    assert "data.tar_path" in line


def test_dpo_rejects_prompt_dataset_path():
    assert "data.path: DPO does not read prompt datasets" in one_problem(
        {"algo": {"kind": "dpo"}, "data": {"path": "x.jsonl"}})


@pytest.mark.parametrize("key,value", [("id_column", "id"), ("metadata_columns", ["a"])])
def test_ppo_only_keys(key, value):
    for kind in ("grpo", "dpo", "opd"):
        line = one_problem({"algo": {"kind": kind}, "data": {key: value}})
        assert f"data.{key}: only used by PPO" in line
    recipe_from_mapping({"algo": {"kind": "ppo"}, "data": {key: value}})


@pytest.mark.parametrize("key,value,readers", [
    ("image_column", "img", "GRPO, PPO, OPD and SFT"),
    ("video_column", "vid", "GRPO, PPO and OPD")])
def test_media_columns_are_for_the_kinds_that_read_them(key, value, readers):
    line = one_problem({"algo": {"kind": "dpo"}, "data": {key: value}})
    assert f"data.{key}: only used by {readers}" in line
    for kind in ("ppo", "grpo", "opd"):
        recipe_from_mapping({"algo": {"kind": kind}, "data": {key: value}})


@pytest.mark.parametrize("key,value", [("jsonl_path", "p.jsonl"), ("tar_path", "p.tar"),
                                       ("synthetic_pairs", 5)])
def test_dpo_only_keys(key, value):
    assert f"data.{key}: only used by DPO" in one_problem({"data": {key: value}})


def test_teacher_factory_only_for_cross_token_opd():
    raw = {"data_packer": {"teacher_model_factory": "a.b"}}
    assert "data_packer.teacher_model_factory: only used by OPD" in one_problem(raw)
    assert "data_packer.teacher_model_factory" in one_problem({**raw, "algo": {"kind": "opd"}})
    recipe_from_mapping({**raw, "algo": {"kind": "opd", "mode": "cross_token_multimodal"}})


@pytest.mark.parametrize("raw,key", [
    ({"algo": {"group_size": 1}}, "algo.group_size"),
    ({"train": {"lr": 0.0}}, "train.lr"),
    ({"train": {"lr": -1e-4}}, "train.lr"),
    ({"run": {"max_steps": 0}}, "run.max_steps"),
    ({"rollout": {"temperature": 0.0}}, "rollout.temperature"),
    ({"rollout": {"top_p": 1.5}}, "rollout.top_p"),
    ({"algo": {"kind": "dpo", "beta": 0.0}}, "algo.beta"),
    ({"algo": {"kind": "dpo", "label_smoothing": 0.5}}, "algo.label_smoothing"),
    ({"algo": {"kind": "ppo", "lam": 1.5}}, "algo.lam"),
    ({"algo": {"kind": "opd", "teacher_path": ""}}, "algo.teacher_path"),
    ({"algo": {"minibatches": 3}}, "algo.minibatches"),
    ({"data": {"operators": ["/"]}}, "data.operators[0]"),
    ({"data": {"min_operand": 5, "max_operand": 2}}, "data.max_operand"),
    ({"reward": {"functions": ["a", "b.c"]}}, "reward.functions[0]"),
    ({"reward": {"weights": [1.0, 2.0]}}, "reward.weights"),
    ({"data": {"factory": "not a path"}}, "data.factory"),
    ({"launch": {"placement": "separate"}}, "launch.placement"),  # a ray key without ray
    ({"launch": {"backend": "ray", "cpus_per_rank": -1.0}}, "launch.cpus_per_rank"),
    ({"launch": {"backend": "ray", "cpus_per_rank": 0.0}}, "launch.cpus_per_rank"),
    ({"launch": {"backend": "ray", "placement": "separate", "rollout_actors": 2}},
     "launch.rollout_actors"),  # more actors than ranks
    ({"launch": {"backend": "ray", "rollout_actors": 2, "num_processes": 2}},
     "launch.rollout_actors"),  # rollout actors without placement = 'separate'
    ({"launch": {"num_processes": 2}}, "launch.num_processes"),
    ({"reward": {"timeout_s": -1.0}}, "reward.timeout_s"),
    ({"algo": {"kind": "dpo", "sft_weight": -0.1}}, "algo.sft_weight"),
    ({"algo": {"kind": "dpo", "loss": "ipo", "label_smoothing": 0.1}}, "algo.label_smoothing"),
    ({"eval": {"max_new_tokens": -1}}, "eval.max_new_tokens"),
    ({"eval": {"num_samples": 0}}, "eval.num_samples"),
    ({"eval": {"temperature": -0.5}}, "eval.temperature"),
    ({"eval": {"num_samples": 4}}, "eval.num_samples"),  # several greedy samples are all the same
])
def test_range_rules_name_key(raw, key):
    assert f"r.toml: {key}:" in one_problem(raw)


def test_new_keys_defaults_reproduce_todays_behaviour():
    r = Recipe()
    assert (r.eval.max_new_tokens, r.eval.num_samples, r.eval.temperature) == (0, 1, 0.0)
    assert r.reward.timeout_s == 60.0 and r.train.disable_dropout is True
    assert DPOConfig().sft_weight == 0.0
    ok = recipe_from_mapping({"eval": {"num_samples": 4, "temperature": 0.7, "max_new_tokens": 32},
                              "algo": {"kind": "dpo", "sft_weight": 0.2}})
    assert ok.eval.num_samples == 4 and ok.algo.sft_weight == 0.2


# --- overrides -----------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [("4", 4), ("0.5", 0.5), ("true", True), ("[1, 2]", [1, 2]),
                                        ('"quoted"', "quoted"), ("plain words", "plain words"),
                                        ("my.module.fn", "my.module.fn"), ("{a = 1}", {"a": 1})])
def test_override_values_are_toml_literals(text, value):
    assert parse_value(text) == value


def test_overrides_apply_and_plus_prefix_is_equal():
    a = recipe_from_mapping({}, overrides=["algo.group_size=4", "data.factory_kwargs.count=1000"])
    b = recipe_from_mapping({}, overrides=["+algo.group_size=4", "+data.factory_kwargs.count=1000"])
    assert a == b
    assert a.algo.group_size == 4 and a.data.factory_kwargs == {"count": 1000}


def test_override_of_unknown_key_is_named():
    line = one_problem({}, overrides=("algo.grup_size=3",))
    assert line.startswith("command line: algo.grup_size: unknown key 'grup_size'")
    assert "Did you mean 'group_size'" in line


def test_override_switching_kind_checks_new_kind_keys():
    recipe = recipe_from_mapping({}, overrides=["algo.kind=dpo", "algo.beta=0.2"])
    assert recipe.algo.beta == 0.2


def test_override_without_equals():
    assert "not an override" in one_problem({}, overrides=("algo.group_size",))


def test_override_type_error_marked_as_command_line():
    line = one_problem({}, overrides=("run.seed=abc",))
    assert line.startswith("command line: run.seed: expected an integer (got 'abc')")


# --- resolved recipe -----------------------------------------------------------------------

@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_resolved_round_trip(path, tmp_path):
    recipe = load_recipe(path, ["run.seed=3"])
    out = write_resolved(recipe, tmp_path / "recipe.resolved.toml", ["run.seed=3"], str(path))
    text = out.read_text()
    assert 'overrides = [\n    "run.seed=3",\n]' in text or "run.seed=3" in text
    assert recipe_hash(recipe) in text and "torch" in text
    assert load_recipe(out) == recipe


def test_hash_changes_with_content():
    assert recipe_hash(Recipe()) != recipe_hash(recipe_from_mapping({"run": {"seed": 1}}))
    assert recipe_hash(Recipe()) == recipe_hash(recipe_from_mapping({}))


def test_recipe_package_does_not_import_torch():
    code = ("import sys, runner.recipe, runner.recipe.resolved, runner.recipe.jsonschema, "
            "runner.cli, runner.preflight; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_schema_file_in_sync(repo):
    from runner.recipe.jsonschema import render

    on_disk = (repo / "schemas" / "recipe.schema.json").read_text()
    assert on_disk == render(), "schemas/recipe.schema.json is stale: run `make schema`"


def test_schema_describes_union_and_enums():
    from runner.recipe.jsonschema import build_schema

    schema = build_schema()
    kinds = [alt["properties"]["kind"]["const"] for alt in schema["properties"]["algo"]["oneOf"]]
    assert kinds == ["grpo", "dpo", "ppo", "opd", "sft", "rm"]
    resume = schema["properties"]["data"]["properties"]["cursor_resume"]
    assert resume["enum"] == ["strict", "auto", "off"] and resume["default"] == "auto"
    assert resume["description"]


def test_ray_keys_are_refused_off_ray_exactly_when_they_leave_the_schema_default():
    """The check reads each Ray key's default from the schema: the default passes under the
    local backend, any other value is refused naming the key."""
    from runner.recipe import load_recipe
    from runner.recipe.checks import _RAY_KEYS
    from runner.recipe.schema import LaunchConfig, default_of
    from tests.conftest import REPO

    other = {"ray_address": "'127.0.0.1:1'", "ray_runtime_env": "{ working_dir = '.' }",
             "placement": "'separate'", "rollout_actors": "2", "cpus_per_rank": "2.0",
             "gpus_per_rank": "1.0", "cpus_per_role_actor": "2.0", "gpus_per_role_actor": "1.0"}
    assert set(other) == set(_RAY_KEYS)
    recipe = REPO / "recipes" / "grpo-arith.toml"
    for key in _RAY_KEYS:
        default = default_of(LaunchConfig, key)
        assert getattr(load_recipe(recipe, []).launch, key) == default
        with pytest.raises(RecipeError, match=f"launch.{key}: is a key of the ray backend"):
            load_recipe(recipe, [f"launch.{key}={other[key]}"])
