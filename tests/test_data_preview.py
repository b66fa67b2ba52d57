"""Dry-run rows of the data: built from the same sources a run uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.data.preview import canonical, describe_data
from runner.recipe.load import load_recipe
from runner.recipe.schema import DataConfig, DPOConfig, PPOConfig, Recipe, ValidationConfig
from runner.types import ObsBundle

ROOT = Path(__file__).resolve().parents[1]
EX = "examples.posttrain_extensions"


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


def test_default_recipe_rows():
    rows = dict(describe_data(Recipe()))
    assert list(rows) == ["data source", "dataset size", "first item", "order", "fingerprint",
                          "cursor resume", "held-out", "overlap check"]
    assert rows["overlap check"] == ("training ids from the problem keys, held-out ids from the "
                                     "problem keys")
    assert rows["data source"] == "builtin: built-in arithmetic (train)"
    assert rows["dataset size"] == "2000"
    assert rows["held-out"] == "64 items, builtin: built-in arithmetic (held_out)"
    assert rows["first item"].startswith('{"prompt": "What is ')
    assert len(rows["fingerprint"]) == 16


def test_dpo_and_factory_rows():
    rows = dict(describe_data(Recipe(algo=DPOConfig(), data=DataConfig(
        factory=f"{EX}.build_preference_dataset", factory_kwargs={"count": 10},
        validation=ValidationConfig(factory=f"{EX}.build_held_out_preference_dataset")))))
    assert rows["data source"] == f"factory: {EX}.build_preference_dataset(count=10)"
    assert rows["first item"] == ('{"prompt": "What is 0 + 7?", "chosen": "7", "rejected": "8", '
                                  '"id": "train-0"}')
    assert rows["held-out"] == f"20 items, factory: {EX}.build_held_out_preference_dataset()"


def test_ppo_rows_with_validation_off():
    rows = dict(describe_data(Recipe(algo=PPOConfig(), data=DataConfig(
        factory=f"{EX}.build_prompt_dataset", prompt_column="question", response_column="answer",
        shuffle=False, validation=ValidationConfig(enabled=False)))))
    assert rows["first item"] == '{"prompt": "What is 0 + 7?", "reference": "7"}'
    assert (rows["order"], rows["held-out"]) == ("file order",
                                                 "off: data.validation.enabled is false")


def test_custom_source_without_held_out_set_says_it_trains_without_evaluation():
    rows = dict(describe_data(Recipe(data=DataConfig(
        factory=f"{EX}.build_prompt_dataset", prompt_column="question", response_column="answer"))))
    assert rows["held-out"] == (
        "none: no held-out set is given for the data.factory training source, so the run trains "
        "without held-out evaluation; set data.validation.factory or data.validation.path to "
        "evaluate")
    assert "overlap check" not in rows


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_recipe_describes_its_data(path):
    rows = dict(describe_data(load_recipe(path)))
    assert int(rows["dataset size"]) > 0


def test_canonical_form_is_cut():
    text = canonical(ObsBundle(prompt="x" * 500))
    assert len(text) == 200 and text.endswith("...")
