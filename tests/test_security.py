"""Files a run loads are never unpickled, and ``--validate`` refuses what the run refuses.

- a model folder or a checkpoint whose weights are a pickle (``pytorch_model.bin``) is refused
  with one line; a pickle beside ``model.safetensors`` is never opened;
- a model folder whose ``model_type`` needs the code of its ``auto_map`` fails ``--validate``
  with the run's own line (exit 2, asking for ``model.trust_remote_code``).
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from runner.errors import RecipeError, RuntimeFailure
from runner.models.loading import load_causal_lm
from runner.state.layout import TrainingState
from runner.state.load import LoadedCheckpoint
from runner.state.pick import refuse_pickled
from tests.conftest import REPO


class _Marker:
    """Unpickling this writes a file: proof that a pickle was opened."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "unpickled"))


def _tiny_llama(folder: Path, pickled: bool) -> None:
    """A tiny Llama folder; ``pickled``: its weights as pytorch_model.bin instead of safetensors
    (which transformers 5 no longer writes itself)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    if pickled:
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()


def test_pickled_model_folder_is_refused_in_one_line(tmp_path):
    _tiny_llama(tmp_path, pickled=True)
    assert (tmp_path / "pytorch_model.bin").is_file()
    with pytest.raises(RecipeError) as info:
        load_causal_lm(tmp_path)
    assert info.value.lines() == [
        f"model.path: {tmp_path}: the weights are pickled (pytorch_model.bin) and there is no "
        "model.safetensors: weights are loaded from safetensors only (nothing is unpickled). "
        "Convert the weights to safetensors where you trust them (save_pretrained writes "
        "model.safetensors)."]


def test_a_pickle_beside_safetensors_is_never_opened(tmp_path):
    _tiny_llama(tmp_path, pickled=False)
    marker = tmp_path / "RAN"
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_Marker(marker)))
    model = load_causal_lm(tmp_path)
    assert model.config.hidden_size == 8
    assert not marker.exists()


def test_checkpoint_with_pickled_weights_is_refused_in_one_line(tmp_path):
    model = tmp_path / "step-000002" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Marker(tmp_path / "RAN")))
    ckpt = LoadedCheckpoint(model.parent, TrainingState(2, None, {}), [], {}, {}, [])
    with pytest.raises(RuntimeFailure) as info:
        refuse_pickled(ckpt)
    assert str(info.value) == (
        f"resume: cannot load checkpoint {model.parent}: model/ holds pickled weights "
        "(pytorch_model.bin) and no model.safetensors; weights are loaded from safetensors only "
        "(nothing is unpickled)")
    assert not (tmp_path / "RAN").exists()


def test_runner_never_unpickles():
    """No module of the package calls torch.load or imports pickle (Ray pickles its own
    messages between the processes of a run; no file is read that way)."""
    unpickles = re.compile(r"torch\.load\(|^\s*(import|from)\s+(pickle|dill|cloudpickle)\b",
                           re.MULTILINE)
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "runner").rglob("*.py")
                 if unpickles.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


GRPO = "recipes/grpo-arith.toml"


def _remote_folder(folder: Path) -> Path:
    """A model folder whose model_type transformers does not know, with code in its auto_map
    that leaves a file behind if it ever runs."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "my-remote", "architectures": ["MyModel"],
        "auto_map": {"AutoConfig": "modeling_my.MyConfig",
                     "AutoModelForCausalLM": "modeling_my.MyModel"}}))
    (folder / "modeling_my.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n")
    return folder


def test_validate_refuses_auto_map_code_as_the_run_does(run_cli, tmp_path):
    folder = _remote_folder(tmp_path / "remote")
    with pytest.raises(RecipeError) as run:  # what the run's loader says
        load_causal_lm(folder)
    rc, out, err = run_cli("--validate", GRPO, f"model.path={folder}")
    assert (rc, out) == (2, "")
    assert err.splitlines() == [f"{GRPO}: {line}" for line in run.value.lines()]
    assert "model.trust_remote_code: " in err
    assert not (folder / "RAN").exists()


def test_validate_refuses_an_unknown_model_type(run_cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "zorblax"}))
    rc, _, err = run_cli("--validate", GRPO, f"model.path={tmp_path}")
    assert rc == 2
    assert err == (f"{GRPO}: model.path: {tmp_path}: transformers does not know model_type "
                   "'zorblax' and the folder brings no code for it. Upgrade transformers or use "
                   "another model.\n")
