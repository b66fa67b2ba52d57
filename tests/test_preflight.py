"""--validate checks what a run needs from the file system: model folders and the output folder."""

from __future__ import annotations

import os

import pytest

from runner.preflight import check_output_dir, validate_models
from runner.recipe import recipe_from_mapping

GRPO, OPD, PPO = "recipes/grpo-arith.toml", "recipes/opd-arith.toml", "recipes/ppo-arith.toml"


@pytest.mark.parametrize("recipe, override, line", [
    (GRPO, "model.path=/no/such/folder", "model.path: model folder not found (got "
     "'/no/such/folder'). Give a local Hugging Face model folder, a run folder, or builtin:NAME."),
    (OPD, "algo.teacher_path=/no/such/teacher", "algo.teacher_path: model folder not found (got "
     "'/no/such/teacher')."),
    (PPO, "algo.critic_path=/no/such/critic", "algo.critic_path: model folder not found (got "
     "'/no/such/critic')."),
    (GRPO, "model.path=builtin:nope", "model.path: unknown built-in model (got 'builtin:nope')."),
])
def test_validate_refuses_a_missing_model_folder(run_cli, recipe, override, line):
    rc, out, err = run_cli("--validate", recipe, override)
    assert rc == 2 and out == ""
    assert err.startswith(f"{recipe}: {line}"), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_validate_refuses_a_folder_without_config(run_cli, tmp_path):
    rc, _, err = run_cli("--validate", GRPO, f"model.path={tmp_path}")
    assert rc == 2
    assert err == f"{GRPO}: model.path: the folder has no config.json (got '{tmp_path}'). " \
                  "A Hugging Face model folder holds config.json beside the weights.\n"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a Linux /proc")
def test_an_output_dir_that_cannot_be_made_is_one_line_exit_2(run_cli):
    rc, out, err = run_cli("--validate", GRPO, "run.output_dir=/proc/no-such/run")
    assert rc == 2 and out == ""
    assert err == (f"{GRPO}: run.output_dir: cannot be made: no folder can be created in /proc "
                   f"({os.strerror(2)}) (got '/proc/no-such/run'). Choose a writable location "
                   "for run.output_dir.\n")


def test_output_dir_rules(tmp_path):
    (tmp_path / "file").write_text("x")
    assert check_output_dir(str(tmp_path / "new" / "deeper")) == []
    assert not (tmp_path / "new").exists()  # the probe leaves nothing behind
    assert os.listdir(tmp_path) == ["file"]
    assert check_output_dir(str(tmp_path)) == []
    (problem,) = check_output_dir(str(tmp_path / "file"))
    assert problem.render() == f"run.output_dir: exists and is not a folder (got " \
                               f"'{tmp_path / 'file'}'). Choose a folder path for the run's " \
                               "outputs."
    (problem,) = check_output_dir(str(tmp_path / "file" / "run"))
    assert problem.message == f"cannot be made: {tmp_path / 'file'} is not a folder"


def test_validate_checks_every_model_without_building_builtins(monkeypatch, tmp_path):
    import runner.models.builtin as builtin

    monkeypatch.setattr(builtin, "ensure_built", lambda name: pytest.fail(f"built {name}"))
    recipe = recipe_from_mapping({"run": {"output_dir": str(tmp_path / "out")},
                                  "algo": {"kind": "opd", "mode": "cross_token_multimodal"}})
    assert validate_models(recipe) == []


def test_the_vocab_check_loads_tokenizers_with_trust_remote_code(monkeypatch):
    from runner import models
    from runner.models import resolve_model_path
    from runner.models.vocab import check_same_vocab

    path = resolve_model_path("builtin:tiny-arith")
    calls = []
    real = models.load_tokenizer
    monkeypatch.setattr(
        models, "load_tokenizer",
        lambda p, trust_remote_code=False: calls.append(trust_remote_code) or real(p))
    check_same_vocab(path, path, trust_remote_code=True)
    assert calls == [True, True]
