"""The reference document's extension module, verbatim, and every command of that document
run through the CLI: ``--validate-manifest``, ``--validate``, ``--dry-run`` and a 2-step run of
each algorithm.

``REFERENCE_MODULE`` below is the module of "Custom datasets and DataPackers" exactly as written
there, with only its imports mapped to ``runner.*`` (DESIGN.md, section 5). It is written to a
temporary ``my_project/posttrain_extensions.py`` and the commands run with that folder on
``PYTHONPATH``, as the document says.

The module imports ``Qwen3VLDataPacker`` (``runner.packers.qwen3_vl``) at the top and its
``build_teacher_model_packer`` returns one: the cross-token OPD commands with
``data_packer.teacher_model_factory`` run with ``builtin:tiny-qwen3-vl`` as that teacher.
``runnable_module()`` still drops exactly those two pieces if the packer module is absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# --- the module, verbatim (imports mapped to runner.*) --------------------------------------------

REFERENCE_MODULE = '''from typing import Any

from runner.packers.base import DataPacker
from runner.packers.decoder_only import (
    DecoderOnlyLLMDataPacker,
    RLPolicyInput,
)
from runner.packers.qwen3_vl import Qwen3VLDataPacker
from runner.types import ObsBundle


class PromptDataset:
    """Map-style raw rows with a stable exact-resume identity."""

    def __init__(self, count: int = 100) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, str]:
        return {"question": f"What is {index} + 1?", "answer": str(index + 1)}

    def cursor_fingerprint(self) -> str:
        return f"example-prompts-v1-count={self.count}"


def build_prompt_dataset(count: int = 100) -> PromptDataset:
    return PromptDataset(count)


class PreferenceDataset:
    """Canonical DPO items with metadata-only leakage identities."""

    def __init__(self, count: int = 100) -> None:
        self._items: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
            (
                f"Describe sample {index}",
                {"sample": f"preferred-{index}"},
                {"sample": f"rejected-{index}"},
            )
            for index in range(count)
        ]

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> tuple[str, dict[str, Any], dict[str, Any]]:
        return self._items[index]

    def membership_ids(self) -> tuple[str, ...]:
        """Return stable aliases without reading or decoding media payloads."""
        return tuple(f"preference-pair-{index}" for index in range(len(self._items)))


def build_preference_dataset(count: int = 100) -> PreferenceDataset:
    return PreferenceDataset(count)


class CustomDataPacker(DecoderOnlyLLMDataPacker):
    """One model-owned contract with rollout-side and policy-side APIs."""

    def get_rollout_input(self, item: ObsBundle) -> str:
        prompt = super().get_rollout_input(item)
        return f"<domain>{prompt}"

    def get_policy_input(
        self,
        sample: ObsBundle,
        rollout_output: Any,
        n_ignore_prefix_tokens: int = 0,
        *,
        prompt_ids: list[int] | None = None,
    ) -> RLPolicyInput:
        return super().get_policy_input(
            sample,
            rollout_output,
            n_ignore_prefix_tokens,
            prompt_ids=prompt_ids,
        )


def build_default_packer() -> DataPacker:
    return CustomDataPacker()


def build_teacher_model_packer() -> DataPacker:
    """Construct the distinct Qwen3-VL teacher model's packing contract."""
    return Qwen3VLDataPacker()
'''


QWEN3_VL_IMPORT = "from runner.packers.qwen3_vl import Qwen3VLDataPacker\n"
TEACHER_FACTORY = \
    'def build_teacher_model_packer() -> DataPacker:\n' \
    '    """Construct the distinct Qwen3-VL teacher model\'s packing contract."""\n' \
    '    return Qwen3VLDataPacker()\n'
HAS_QWEN3_VL = importlib.util.find_spec("runner.packers.qwen3_vl") is not None
NEEDS_QWEN3_VL = pytest.mark.skipif(
    not HAS_QWEN3_VL, reason="needs runner.packers.Qwen3VLDataPacker (another issue); the "
    "reference module's teacher packer factory returns one")

EXT = "my_project.posttrain_extensions"
GRPO, PPO, OPD, DPO = (f"recipes/{n}-arith.toml" for n in ("grpo", "ppo", "opd", "dpo"))

# The document's commands, as our overrides: `rl.data.X` is `data.X`; `+key=value` as written.
PROMPT_SOURCE = (f"data.factory={EXT}.build_prompt_dataset", "+data.factory_kwargs.count=1000",
                 "data.prompt_column=question", "data.response_column=answer")
# DPO: the dpo-arith recipe's own source (synthetic_pairs) must be unset to use a factory
# ("Do not combine factory with ... synthetic_pairs"): an experiment override.
PREFERENCE_SOURCE = (f"data.factory={EXT}.build_preference_dataset",
                     "+data.factory_kwargs.count=1000", "data.shuffle=true",
                     "data.synthetic_pairs=0")
DEFAULT_PACKER = (f"data_packer.factory={EXT}.build_default_packer",)
# The teacher packer is a Qwen3VLDataPacker: the "distinct Qwen3-VL teacher model" is the tiny
# built-in one (the student stays the recipe's text model); a teacher with its own vocabulary
# has no full-vocabulary KL with the student.
TEACHER_PACKER = (f"data_packer.factory={EXT}.build_default_packer",
                  f"data_packer.teacher_model_factory={EXT}.build_teacher_model_packer",
                  "algo.mode=cross_token_multimodal", "algo.teacher_path=builtin:tiny-qwen3-vl",
                  "algo.full_kl=false")  # opd-arith's exact KL needs one shared vocabulary
# Small and short: the experiment-and-model overrides of a test.
TWO_STEPS = ("run.max_steps=2", "checkpoint.every_steps=2", "rollout.max_new_tokens=4")
SMALL = {"grpo": ("algo.prompts_per_step=4", "algo.group_size=2", "algo.minibatches=1"),
         "ppo": ("algo.prompts_per_step=4", "algo.minibatches=1"),
         "opd": ("algo.prompts_per_step=4",),
         "dpo": ("algo.pairs_per_step=4",)}


def runnable_module() -> str:
    """The reference module as it can run today: all of it once Qwen3VLDataPacker exists,
    else without the two pieces that need it (each must be there exactly once)."""
    if HAS_QWEN3_VL:
        return REFERENCE_MODULE
    for piece in (QWEN3_VL_IMPORT, TEACHER_FACTORY):
        assert REFERENCE_MODULE.count(piece) == 1, piece
    return REFERENCE_MODULE.replace(QWEN3_VL_IMPORT, "").replace(TEACHER_FACTORY, "")


@pytest.fixture(scope="module")
def extension_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("extension-root")
    (root / "my_project").mkdir()
    (root / "my_project" / "__init__.py").write_text("")
    (root / "my_project" / "posttrain_extensions.py").write_text(runnable_module())
    return root


@pytest.fixture
def cli(extension_root, run_cli, monkeypatch):
    """The CLI in this process with the extension root on the import path (PYTHONPATH=.:root),
    its tables wide enough that no value wraps."""
    monkeypatch.syspath_prepend(str(extension_root))
    monkeypatch.setenv("COLUMNS", "400")
    return run_cli


def run_subprocess(extension_root: Path, *argv: str) -> subprocess.CompletedProcess:
    """``PYTHONPATH=.:<extension-root> python -m runner.cli ...`` from the repository root."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{extension_root}"}
    return subprocess.run([sys.executable, "-m", "runner.cli", "--plain", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=env)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


NO_HELD_OUT = ("none: no held-out set is given for the data.factory training source, so the run "
               "trains without held-out evaluation; set data.validation.factory or "
               "data.validation.path to evaluate")


# --- the factory paths load -----------------------------------------------------------------------

def test_every_factory_path_loads_and_a_wrong_name_is_named(extension_root, monkeypatch):
    from runner.errors import ExtensionError
    from runner.extensions import load_callable

    monkeypatch.syspath_prepend(str(extension_root))
    names = ["build_prompt_dataset", "build_preference_dataset", "build_default_packer"]
    for name in names + (["build_teacher_model_packer"] if HAS_QWEN3_VL else []):
        assert callable(load_callable(f"{EXT}.{name}"))
    # The document's own one-liner names `build_dataset`, which its module does not define.
    with pytest.raises(ExtensionError, match=rf"{EXT}.build_dataset: '{EXT}' has no attribute "
                       "'build_dataset'"):
        load_callable(f"{EXT}.build_dataset")


# --- prompt sources: GRPO, PPO, OPD -------------------------------------------------------------

@pytest.mark.parametrize("recipe", [GRPO, PPO, OPD], ids=["grpo", "ppo", "opd"])
def test_prompt_source_validates_and_dry_runs(cli, recipe):
    rc, out, err = cli("--validate-manifest", recipe, *PROMPT_SOURCE)
    assert rc == 0, err
    rc, out, err = cli("--validate", recipe, *PROMPT_SOURCE)
    assert (rc, err) == (0, ""), err
    assert "recipe and extensions are valid" in out
    rc, out, err = cli("--plain", "--dry-run", recipe, *PROMPT_SOURCE)
    assert (rc, err) == (0, ""), err
    assert f"factory: {EXT}.build_prompt_dataset(count=1000)" in out
    assert '{"prompt": "What is 0 + 1?", "reference": "1"}' in out
    assert NO_HELD_OUT in out
    assert "rollout input" in out and "What is 0 + 1?" in out


@pytest.mark.slow
@pytest.mark.parametrize("recipe, kind", [(GRPO, "grpo"), (PPO, "ppo"), (OPD, "opd")],
                         ids=["grpo", "ppo", "opd"])
def test_prompt_source_trains_two_steps(extension_root, tmp_path, recipe, kind):
    done = run_subprocess(extension_root, recipe, *PROMPT_SOURCE, *TWO_STEPS, *SMALL[kind],
                          f"run.output_dir={tmp_path}")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]  # no held-out set: no step-0 evaluation
    assert not any(k.startswith("eval/") for r in rows for k in r)
    assert (tmp_path / "checkpoints" / "step-000002" / "COMPLETE").is_file()
    resolved = (tmp_path / "recipe.resolved.toml").read_text()
    assert f'factory = "{EXT}.build_prompt_dataset"' in resolved and "count = 1000" in resolved


@pytest.mark.slow
def test_the_run_says_at_start_that_it_has_no_held_out_evaluation(extension_root, tmp_path):
    done = run_subprocess(extension_root, GRPO, *PROMPT_SOURCE, *TWO_STEPS, *SMALL["grpo"],
                          f"run.output_dir={tmp_path}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert NO_HELD_OUT in done.stdout.splitlines()[0]


# --- DPO preference source ----------------------------------------------------------------------

def test_preference_source_validates_and_dry_runs(cli):
    rc, out, err = cli("--validate", DPO, *PREFERENCE_SOURCE)
    assert (rc, err) == (0, ""), err
    # dpo-arith evaluates on held-out pairs, and the document's module gives no held-out
    # preference source: refused before anything is built, saying how to go on.
    rc, out, err = cli("--plain", "--dry-run", DPO, *PREFERENCE_SOURCE)
    assert rc == 2 and "Traceback" not in err
    assert err == ("data.validation: validation is on but no held-out set is given for the "
                   "data.factory training source. Set data.validation.jsonl_path or "
                   "data.validation.factory, or data.validation.enabled=false.\n")
    rc, out, err = cli("--plain", "--dry-run", DPO, *PREFERENCE_SOURCE,
                       "data.validation.enabled=false")
    assert (rc, err) == (0, ""), err
    text = " ".join(out.split())
    assert f"factory: {EXT}.build_preference_dataset(count=1000)" in text
    # The {"sample": ...} payloads are read as text by the built-in packer.
    assert "chosen sequence" in text and "preferred-" in text and "rejected-" in text


@pytest.mark.slow
def test_preference_source_trains_two_steps(extension_root, tmp_path):
    done = run_subprocess(extension_root, DPO, *PREFERENCE_SOURCE, "data.validation.enabled=false",
                          *TWO_STEPS, *SMALL["dpo"], f"run.output_dir={tmp_path}")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and "reward_margin" in rows[0]
    assert (tmp_path / "checkpoints" / "step-000002" / "COMPLETE").is_file()


# --- the DataPacker factories -------------------------------------------------------------------

def test_default_packer_factory_validates_and_dry_runs(cli):
    rc, out, err = cli("--validate", GRPO, *DEFAULT_PACKER)
    assert (rc, err) == (0, ""), err
    rc, out, err = cli("--plain", "--dry-run", GRPO, *DEFAULT_PACKER)
    assert (rc, err) == (0, ""), err
    assert "my_project.posttrain_extensions.CustomDataPacker" in out
    assert "'<domain><|bos|>" in out  # the subclass's rollout input, as the engine gets it


@pytest.mark.slow
def test_default_packer_factory_trains_two_steps(extension_root, tmp_path):
    done = run_subprocess(extension_root, GRPO, *DEFAULT_PACKER, *TWO_STEPS, *SMALL["grpo"],
                          "data.validation.size=4", f"run.output_dir={tmp_path}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2]


@NEEDS_QWEN3_VL
def test_teacher_packer_factory_validates_and_dry_runs(cli):
    rc, out, err = cli("--validate", OPD, *TEACHER_PACKER)
    assert (rc, err) == (0, ""), err
    rc, out, err = cli("--plain", "--dry-run", OPD, *TEACHER_PACKER)
    assert (rc, err) == (0, ""), err


@NEEDS_QWEN3_VL
@pytest.mark.slow
def test_teacher_packer_factory_trains_two_steps(extension_root, tmp_path):
    done = run_subprocess(extension_root, OPD, *TEACHER_PACKER, *TWO_STEPS, *SMALL["opd"],
                          "data.validation.size=4", f"run.output_dir={tmp_path}")
    assert done.returncode == 0, done.stdout + done.stderr
