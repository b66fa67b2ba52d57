"""A model folder whose model_type needs its own code: one named problem, and its code never
runs while model.trust_remote_code is false."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.errors import RecipeError
from runner.models.loading import load_causal_lm, load_tokenizer

MODELING = '''
import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("remote code ran")
'''


@pytest.fixture
def remote(tmp_path) -> Path:
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "my-remote", "architectures": ["MyModel"],
        "auto_map": {"AutoConfig": "modeling_my.MyConfig",
                     "AutoModelForCausalLM": "modeling_my.MyModel"}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MyTok", "auto_map": {"AutoTokenizer": ["modeling_my.MyTok", None]}}))
    (folder / "modeling_my.py").write_text(MODELING)
    return folder


@pytest.mark.parametrize("load", [load_causal_lm, load_tokenizer])
def test_remote_code_model_type_is_one_problem(remote, load):
    with pytest.raises(RecipeError) as info:
        load(remote)
    assert info.value.lines() == [
        f"model.trust_remote_code: {remote}: model_type 'my-remote' needs the Python code in the "
        "model folder (its auto_map), which runs only when allowed (got False). Set "
        "model.trust_remote_code = true if you trust that code, or use a model whose type "
        "transformers knows."]
    assert not (remote / "RAN").exists()


def test_unknown_model_type_without_code(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "zorblax"}))
    with pytest.raises(RecipeError) as info:
        load_causal_lm(tmp_path)
    assert info.value.lines() == [
        f"model.path: {tmp_path}: transformers does not know model_type 'zorblax' and the "
        "folder brings no code for it. Upgrade transformers or use another model."]
    with pytest.raises(RecipeError) as info:
        load_tokenizer(tmp_path)
    assert info.value.lines() == [
        f"model.path: {tmp_path}: holds no tokenizer transformers can load. A model folder "
        "needs tokenizer.json (or a slow tokenizer's files)."]
