"""Inputs a hostile file or a careless user gives: each is refused with one line that names the
file and row (or the dotted path), never trained on, never a traceback or a hang.

The cases are tables: a later round adds rows. Most call the reader or validator directly; the
few that need a run use one step of tiny data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.data.files import load_local
from runner.data.preference import build_pair_source
from runner.data.sources import build_prompt_sources
from runner.errors import RecipeError
from runner.recipe.schema import DataConfig, ValidationConfig

OFF = ValidationConfig(enabled=False)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _one_line(exc: RecipeError, path: Path) -> str:
    lines = exc.lines()
    assert len(lines) == 1, lines
    return lines[0].replace(str(path), "P")


# --- data.path (GRPO, PPO, OPD): rows through datasets -----------------------------------------

def _jsonl(*rows: object) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


GOOD = {"prompt": "1 + 1 =", "answer": "2"}
FIX = " Fix or drop the row, or reshape rows with data.items_fn."

PATH_CASES = {
    # a key missing from a later row: datasets fills it with null (row 0 is fine)
    "missing prompt in row 2": (
        "p.jsonl", _jsonl(GOOD, GOOD, {"answer": "3"}),
        "data.prompt_column: row 2 of P: column 'prompt' is null or missing." + FIX),
    "null prompt": (
        "p.jsonl", _jsonl(GOOD, {"prompt": None, "answer": "3"}),
        "data.prompt_column: row 1 of P: column 'prompt' is null or missing." + FIX),
    "dict prompt": (
        "p.jsonl", _jsonl({"prompt": {"text": "hi"}, "answer": "3"}),
        "data.prompt_column: row 0 of P: column 'prompt' is a mapping, not text or a list of "
        "chat messages." + FIX),
    "list prompt of strings": (
        "p.jsonl", _jsonl({"prompt": ["a", "b"], "answer": "3"}),
        "data.prompt_column: row 0 of P: column 'prompt' is a list whose element 0 is not a chat "
        "message (a mapping with a text 'role' and a 'content')." + FIX),
    "null answer": (
        "p.jsonl", _jsonl(GOOD, GOOD, GOOD, {"prompt": "x", "answer": None}),
        "data.response_column: row 3 of P: column 'answer' is null or missing (the reward would "
        "compare against nothing)." + FIX),
    "csv cut inside a quoted field": (
        "p.csv", b'prompt,answer\n1 + 1 =,2\n2 + 2 =,"4',
        "data.path: P line 3: not valid CSV (unexpected end of data). Close every quoted field."),
    "csv cut inside the last row": (
        "p.csv", b"prompt,answer\n1 + 1 =,2\n2 + 2 =,1",
        "data.path: P line 3: the last row does not end with a line break, so the file may be "
        "cut inside it. End the file with a line break if it is complete."),
    "ragged csv: more fields than the header": (
        "p.csv", b"prompt,answer\n1 + 1 =,2,extra,more\n2 + 2 =,4\n",
        "data.path: P line 2: the row has 4 fields where the header has 2. Give every row one "
        "field per header column (quote fields that hold commas)."),
    "ragged csv: fewer fields": (
        "p.csv", b"prompt,answer\n1 + 1 =,2\n2 + 2 =\n",
        "data.path: P line 3: the row has 1 fields where the header has 2. Give every row one "
        "field per header column (quote fields that hold commas)."),
    "jsonl with a key twice": (
        "p.jsonl", b'{"prompt": "a", "prompt": "b", "answer": "1"}\n',
        None),  # datasets refuses it (its own words)
}


@pytest.mark.parametrize("name", sorted(PATH_CASES))
def test_data_path_refuses(tmp_path, home, name):
    filename, content, expected = PATH_CASES[name]
    path = tmp_path / filename
    path.write_bytes(content)
    data = DataConfig(path=str(path), prompt_column="prompt", response_column="answer",
                      validation=OFF)
    with pytest.raises(RecipeError) as info:
        build_prompt_sources(data, "grpo")
    line = _one_line(info.value, path)
    if expected is None:
        assert line.startswith("data.path: ") and "twice" in line, line
    else:
        assert line == expected


@pytest.mark.parametrize("filename,content", [
    ("p.csv", b"\xef\xbb\xbfprompt,answer\n1 + 1 =,2\n"),
    ("p.jsonl", b"\xef\xbb\xbf" + _jsonl(GOOD)),
])
def test_data_path_reads_a_bom_as_nothing(tmp_path, home, filename, content):
    path = tmp_path / filename
    path.write_bytes(content)
    ds, _ = load_local(str(path), "train", key="data.path", split_key="data.split")
    assert ds.column_names == ["prompt", "answer"]
    assert [row["prompt"] for row in ds] == ["1 + 1 ="]


def test_chat_message_prompts_are_accepted(tmp_path, home):
    path = tmp_path / "p.jsonl"
    path.write_bytes(_jsonl({"prompt": [{"role": "user", "content": "1 + 1 ="}], "answer": "2"}))
    data = DataConfig(path=str(path), prompt_column="prompt", response_column="answer",
                      validation=OFF)
    train, _ = build_prompt_sources(data, "grpo")
    assert train.item(0).prompt == [{"role": "user", "content": "1 + 1 ="}]


# --- DPO jsonl ----------------------------------------------------------------------------------

PAIR = {"prompt": "p", "chosen": "good", "rejected": "bad"}

PAIR_CASES = {
    "a key twice": (
        b'{"prompt": "p", "chosen": "good", "chosen": "bad", "rejected": "bad"}\n',
        "data.jsonl_path: P line 1: the key 'chosen' appears twice. Give each key once per line."),
    "dict prompt": (
        _jsonl(PAIR, {**PAIR, "prompt": {"text": "p"}}),
        "data.jsonl_path: P line 2: the prompt is a mapping, not text (got {'text': 'p'}). Write "
        "the prompt as a JSON string."),
    "null prompt": (
        _jsonl({**PAIR, "prompt": None}),
        "data.jsonl_path: P line 1: the prompt is null, not text (got None). Write the prompt as "
        "a JSON string."),
}


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_dpo_jsonl_refuses(tmp_path, name):
    content, expected = PAIR_CASES[name]
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(RecipeError) as info:
        build_pair_source(DataConfig(jsonl_path=str(path), validation=OFF))
    assert _one_line(info.value, path) == expected


def test_dpo_jsonl_reads_a_bom_as_nothing(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _jsonl(PAIR, PAIR))
    source = build_pair_source(DataConfig(jsonl_path=str(path), validation=OFF))
    assert len(source) == 2 and source.pair(0).prompt == "p"


# --- rewards ------------------------------------------------------------------------------------

def _reward_outcome(value: object) -> list[float] | str:
    from runner.errors import RewardFailure
    from runner.rewards import RewardSet

    rewards = RewardSet(("judge",), (lambda completions, items: [value] * len(completions),),
                        (1.0,))
    try:
        return rewards.score(["a", "b"], [None, None], step=3)[0]
    except RewardFailure as exc:
        return str(exc)


def _np(name: str, value: object) -> object:
    import numpy as np

    return getattr(np, name)(value)


BEYOND = ("rewards must be at most 1e+15 in magnitude (they train as float32, where a group's "
          "mean and variance must stay finite); scale the reward down")
REWARD_CASES = {
    "1e39 (inf as a float32)": (1e39, f"reward at step 3: judge returned 1e+39 at index 0: "
                                f"{BEYOND}"),
    "-1e308": (-1e308, f"reward at step 3: judge returned -1e+308 at index 0: {BEYOND}"),
    "3e38 (a float32 whose group mean overflows)": (
        3e38, f"reward at step 3: judge returned 3e+38 at index 0: {BEYOND}"),
    "inf": (float("inf"), f"reward at step 3: judge returned inf at index 0: {BEYOND}"),
    "nan": (float("nan"), "reward at step 3: judge returned nan at index 0: NaN is not a reward; "
            "return a finite number"),
    "a string": ("1.0", "reward at step 3: judge returned '1.0' at index 0: a str is not a "
                 "number; return int or float values"),
    "a boolean": (True, "reward at step 3: judge returned True at index 0: a boolean is not a "
                  "number; return int or float values"),
}


@pytest.mark.parametrize("name", sorted(REWARD_CASES))
def test_rewards_that_cannot_train_are_refused(name):
    value, expected = REWARD_CASES[name]
    assert _reward_outcome(value) == expected


@pytest.mark.parametrize("value", [_np("float32", 1.0), _np("float64", 1.0), _np("int64", 1),
                                   _np("float16", 1.0), 1, 1.0])
def test_rewards_of_any_real_number_type_are_accepted(value):
    assert _reward_outcome(value) == [1.0, 1.0]


def test_a_weighted_total_beyond_the_bound_is_refused():
    from runner.errors import RewardFailure
    from runner.rewards import RewardSet

    def one(completions, items):
        return [9e14] * len(completions)

    rewards = RewardSet(("a", "b"), (one, one), (1.0, 1.0))
    with pytest.raises(RewardFailure) as info:
        rewards.score(["x"], [None], step=2)
    assert str(info.value) == ("reward at step 2: the weighted total (reward.weights) is 1.8e+15 "
                               "at item 0, beyond the largest reward (1e+15 in magnitude); lower "
                               "reward.weights or the rewards' scale")


def test_a_total_with_the_env_reward_beyond_the_bound_names_both():
    """The functions' total and the episode's env reward are each within the bound; their sum
    is not (it would overflow the float32 group statistics and be blamed on the policy)."""
    from runner.errors import RewardFailure
    from runner.rewards import RewardSet
    from runner.rollout.base import Completion
    from runner.train.loops.rollouts import reward_trajectory
    from runner.train.loops.trajectory import Trajectory
    from runner.types import ObsBundle

    item = ObsBundle("p")
    traj = Trajectory((item, item), ((1,), (1,)), (Completion((2,), "a", (0.0,), "stop"),) * 2,
                      env_rewards=(0.0, 9e14))
    rewards = RewardSet(("judge",), (lambda completions, items: [9e14] * len(completions),),
                        (1.0,))
    with pytest.raises(RewardFailure) as info:
        reward_trajectory(traj, rewards, 4)
    assert str(info.value) == ("reward at step 4: the reward functions' total plus the env "
                               "reward is 1.8e+15 at item 1 (9e+14 + 9e+14), beyond the largest "
                               "reward (1e+15 in magnitude); scale the rewards down")


# --- a step whose loss or gradient is not finite ------------------------------------------------

@pytest.fixture(scope="module")
def trainable():
    import torch
    from accelerate import Accelerator

    from runner.recipe.schema import Recipe
    from runner.train.roles import prepare_trainable

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return prepare_trainable(Accelerator(cpu=True), model, Recipe())


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_a_non_finite_loss_never_reaches_the_optimizer(trainable, max_grad_norm, poison):
    import torch

    from runner.errors import NonFiniteUpdate
    from runner.train.roles import optimizer_step

    before = {k: v.clone() for k, v in trainable.model.state_dict().items()}
    steps = int(trainable.optimizer.state_dict()["state"].get(0, {}).get("step", 0))

    def loss() -> torch.Tensor:
        out = trainable.model(torch.ones(2, 3)).sum()
        return out * float(poison)

    with pytest.raises(NonFiniteUpdate) as info:
        optimizer_step([trainable], [loss], max_grad_norm)
    assert str(info.value).startswith("policy: the loss is not finite (gradient norm ")
    after = trainable.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert int(trainable.optimizer.state_dict()["state"].get(0, {}).get("step", 0)) == steps


def test_the_loop_names_the_step_and_writes_no_checkpoint():
    from types import SimpleNamespace

    import attrs

    from runner.errors import NonFiniteUpdate
    from runner.recipe.schema import Recipe
    from runner.train.loops.loop import run_loop

    saved, written = [], []

    def one_step(step: int) -> dict:
        if step == 3:
            raise NonFiniteUpdate("the gradient norm is not finite")
        return {"loss": 1.0}

    recipe = Recipe()
    recipe = attrs.evolve(recipe, checkpoint=attrs.evolve(recipe.checkpoint, every_steps=1))
    svc = SimpleNamespace(
        recipe=recipe, metrics=SimpleNamespace(write=written.append),
        reporter=SimpleNamespace(start=lambda *a: None, step=lambda *a: None,
                                 message=lambda *a: None),
        stop_poll=None, comm=SimpleNamespace(any=lambda flag: flag))
    run = SimpleNamespace(svc=svc, state=SimpleNamespace(start_step=0), save=saved.append)
    with pytest.raises(NonFiniteUpdate) as info:
        run_loop(run, one_step, None)
    assert str(info.value) == "policy at step 3: the gradient norm is not finite"
    assert saved == [1, 2] and [row["step"] for row in written] == [1, 2]


# --- the run folder: one run at a time, no writes through links --------------------------------

def test_a_second_run_on_the_same_folder_is_refused(tmp_path):
    from runner.state.run_folder import RunLock

    first = RunLock.acquire(tmp_path / "run")
    with pytest.raises(RecipeError) as info:
        RunLock.acquire(tmp_path / "run")
    assert info.value.lines() == [
        f"run.output_dir: another run (pid {__import__('os').getpid()}) is using "
        f"{tmp_path / 'run'}: it holds {tmp_path / 'run' / 'run.lock'}. Wait for it to finish, "
        "stop it, or choose another run.output_dir."]
    first.release()
    RunLock.acquire(tmp_path / "run").release()


def test_a_killed_run_leaves_no_stuck_lock(tmp_path):
    import signal
    import subprocess
    import sys

    from runner.state.run_folder import RunLock

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from runner.state.run_folder import RunLock; lock = RunLock.acquire(Path(sys.argv[1])); "
         "print('locked', flush=True); time.sleep(60)", str(tmp_path / "run")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RecipeError, match=f"another run \\(pid {holder.pid}\\)"):
            RunLock.acquire(tmp_path / "run")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    RunLock.acquire(tmp_path / "run").release()  # the lock file stays; the lock does not


def test_the_run_refuses_a_locked_folder_before_reading_it(run_cli, tmp_path):
    from runner.state.run_folder import RunLock

    lock = RunLock.acquire(tmp_path / "run")
    try:
        rc, out, err = run_cli("--plain", "recipes/grpo-arith.toml",
                               f"run.output_dir={tmp_path / 'run'}", "run.max_steps=1",
                               "data.validation.enabled=false")
    finally:
        lock.release()
    assert rc == 2, out + err
    assert err.splitlines() == [
        f"run.output_dir: another run (pid {__import__('os').getpid()}) is using "
        f"{tmp_path / 'run'}: it holds {tmp_path / 'run' / 'run.lock'}. Wait for it to finish, "
        "stop it, or choose another run.output_dir."]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.lock"]


@pytest.mark.parametrize("rows", [[], [{"step": 1}]])
def test_metrics_are_never_written_through_a_link(tmp_path, rows):
    from runner.errors import RuntimeFailure
    from runner.ui.metrics import MetricsLog

    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "metrics.jsonl").symlink_to(target)
    with pytest.raises(RuntimeFailure) as info:
        MetricsLog(tmp_path / "metrics.jsonl", rows=rows)
    assert "it is a symbolic link, and the run never writes through one [errno 40]" in str(
        info.value)
    assert target.read_text() == "keep me"



@pytest.mark.parametrize("name", ["checkpoints", "tensorboard", "wandb", "mlruns", "eval"])
def test_a_run_folder_that_is_a_link_is_refused_before_anything_is_written(tmp_path, name):
    """Folders are not followed either: checkpoints/ linked elsewhere would take the run's
    checkpoints (and rotation's deletions) outside the run folder."""
    from runner.errors import RecipeError
    from runner.state.run_folder import RunLock

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(RecipeError) as info:
        RunLock.acquire(run)
    assert info.value.lines() == [
        f"run.output_dir: {run / name} is a symbolic link, and the run never writes through one. "
        "Remove the link (a real folder in its place is fine), or choose another "
        "run.output_dir."]
    assert sorted(p.name for p in run.iterdir()) == [name]  # no lock file either
    assert [p.name for p in elsewhere.iterdir()] == ["precious.txt"]
    (run / name).unlink()
    (run / name).mkdir()
    RunLock.acquire(run).release()  # a real folder is fine


def test_an_eval_folder_that_is_a_link_is_refused(tmp_path):
    from runner.errors import RecipeError
    from runner.eval.job import eval_job
    from runner.recipe import load_recipe, make_plan
    from tests.conftest import REPO

    recipe = load_recipe(REPO / "recipes" / "grpo-arith.toml", [f"run.output_dir={tmp_path}"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "eval").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(RecipeError) as info:
        eval_job(recipe, make_plan(recipe))
    assert info.value.lines() == [
        f"eval: {tmp_path / 'eval'} is a symbolic link, and the run never writes through one. "
        "Remove the link (a real folder in its place is fine), or choose another "
        "run.output_dir."]

def test_the_resolved_recipe_replaces_a_link_instead_of_following_it(tmp_path):
    from runner.recipe.resolved import write_resolved
    from runner.recipe.schema import Recipe

    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    for name in ("recipe.resolved.toml", "recipe.resolved.tmp"):
        (tmp_path / name).symlink_to(target)
    write_resolved(Recipe(), tmp_path / "recipe.resolved.toml")
    assert target.read_text() == "keep me"
    assert not (tmp_path / "recipe.resolved.toml").is_symlink()


# --- checkpoints whose files are whole but do not parse -----------------------------------------

@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from runner.state.checkpoint import WholeState, save_checkpoint
    from runner.state.layout import TrainingState

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg)
    root = tmp_path_factory.mktemp("ckpts") / "checkpoints"
    for step in (1, 2):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        save_checkpoint(root, step, policy=WholeState(model, opt), tokenizer=None,
                        state=TrainingState(step=step, cursor=None,
                                            scheduler={"last_epoch": step}),
                        metrics_rows=[{"step": s} for s in range(1, step + 1)], keep_last=5)
    return root


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _header_length(path: Path, length: int) -> None:
    data = path.read_bytes()
    path.write_bytes(length.to_bytes(8, "little") + data[8:])


def _garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:16] = b"{garble!"
    path.write_bytes(bytes(data))


CKPT_FAULTS = {
    "garbled safetensors header": (
        lambda f: _garble_header(f / "model" / "model.safetensors"),
        "model/model.safetensors: SafetensorError: Error while deserializing header: "),
    "header length 2**40": (
        lambda f: _header_length(f / "model" / "model.safetensors", 2**40),
        "model/model.safetensors: SafetensorError: Error while deserializing header: header "
        "too large"),
    "wrong python RNG state": (
        lambda f: _edit_json(f / "state.json", lambda d: d["rng"][0]["python"].__setitem__(
            1, [1, 2, 3])),
        "the RNG states (state.json 'rng', rng.safetensors): ValueError: state vector is the "
        "wrong size"),
    "wrong torch RNG state": (
        lambda f: __import__("safetensors.torch").torch.save_file(
            {"torch.0": __import__("torch").zeros(10, dtype=__import__("torch").uint8)},
            f / "rng.safetensors"),
        "the RNG states (state.json 'rng', rng.safetensors): RuntimeError: Expected a "
        "CPUGeneratorImplState of size "),
    'step "four"': (
        lambda f: _edit_json(f / "state.json", lambda d: d.__setitem__("step", "four")),
        "state.json: 'step' is \"four\", not of the type a checkpoint records"),
    "state.json step disagrees with the folder name": (
        lambda f: _edit_json(f / "state.json", lambda d: d.__setitem__("step", 7)),
        "its state.json records step 7 but the folder is named step-000002 (renamed or "
        "copied?)"),
    "optimizer state that is not a table": (
        lambda f: _edit_json(f / "optimizer.json", lambda d: d.__setitem__("state", [1])),
        "optimizer.safetensors / optimizer.json: AttributeError: "),
}


def _damage(root: Path, name: str, pre_manifest: bool) -> Path:
    from runner.state.integrity import MANIFEST, write_manifest
    from runner.state.layout import COMPLETE

    folder = root / "step-000002"
    CKPT_FAULTS[name][0](folder)
    if pre_manifest:  # what versions before manifests wrote: no manifest, no world_size
        (folder / MANIFEST).unlink()
        _edit_json(folder / "state.json", lambda d: [d.pop(k) for k in ("world_size",
                                                                       "items_per_step")])
    else:  # the files match their manifest: only parsing can tell
        write_manifest(folder, 2, skip=(COMPLETE,))
    return folder


@pytest.mark.parametrize("pre_manifest", [False, True], ids=["manifest", "pre-manifest"])
@pytest.mark.parametrize("name", sorted(CKPT_FAULTS))
def test_a_checkpoint_that_does_not_parse_falls_back(two_checkpoints, tmp_path, name,
                                                     pre_manifest):
    import shutil

    from runner.state.load import load_latest

    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    folder = _damage(root, name, pre_manifest)
    said: list[str] = []
    loaded = load_latest(root, on_skip=said.append)
    assert loaded is not None and loaded.path == root / "step-000001"
    assert loaded.state.step == 1
    assert len(said) == 1, said
    prefix = f"cannot load checkpoint {folder}: {CKPT_FAULTS[name][1]}"
    assert said[0].startswith(prefix) and said[0].endswith("; skipping it"), said[0]


def test_no_checkpoint_that_parses_is_one_error(two_checkpoints, tmp_path):
    import shutil

    from runner.errors import RuntimeFailure
    from runner.state.load import load_latest

    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    for step in (1, 2):
        _edit_json(root / f"step-00000{step}" / "state.json",
                   lambda d: d.__setitem__("step", "four"))
        from runner.state.integrity import write_manifest
        from runner.state.layout import COMPLETE

        write_manifest(root / f"step-00000{step}", step, skip=(COMPLETE,))
    with pytest.raises(RuntimeFailure) as info:
        load_latest(root, on_skip=lambda line: None)
    assert str(info.value).startswith(f"resume: no intact checkpoint in {root} (step-000002: "
                                      "state.json: 'step' is \"four\"")


@pytest.mark.parametrize("how", ["copied", "renamed"])
def test_a_folder_named_for_another_step_is_skipped_and_never_pruned(two_checkpoints, tmp_path,
                                                                    how):
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from runner.state.checkpoint import WholeState, save_checkpoint
    from runner.state.layout import TrainingState
    from runner.state.load import load_latest

    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    (shutil.copytree if how == "copied" else shutil.move)(root / "step-000002",
                                                           root / "step-000099")
    (root / "latest").write_text("step-000099")
    said: list[str] = []
    loaded = load_latest(root, on_skip=said.append)
    expect = "step-000002" if how == "copied" else "step-000001"
    assert loaded.path == root / expect
    assert said == [f"cannot load checkpoint {root / 'step-000099'}: its state.json records step "
                    "2 but the folder is named step-000099 (renamed or copied?); skipping it"]
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg)
    for step in (3, 4):
        save_checkpoint(root, step, tokenizer=None,
                        policy=WholeState(model, torch.optim.AdamW(model.parameters())),
                        state=TrainingState(step=step, cursor=None, scheduler={}),
                        metrics_rows=[], keep_last=2)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000003", "step-000004",
                                                           "step-000099"]


# --- media: decompression bombs, paths that are not regular files -------------------------------

def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels and holds none (its header is enough
    for a decoder to allocate them)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + \
        chunk(b"IEND", b"")


def _decode_image(value: object) -> str:
    import threading

    from runner.data.media import decode_media
    from runner.types import MediaOrigin, ObsBundle

    item = ObsBundle("q", images=(value,), origin=MediaOrigin("row 3 of shapes.jsonl", "image"))
    outcome: list[str] = []

    def decode() -> None:
        try:
            decode_media(item)
            outcome.append("decoded")
        except RecipeError as exc:
            outcome.extend(exc.lines())

    thread = threading.Thread(target=decode, daemon=True)  # a hang fails the test, not the suite
    thread.start()
    thread.join(20)
    assert outcome, "decoding did not finish within 20 s"
    return outcome[0] if len(outcome) == 1 else repr(outcome)


def test_a_decompression_bomb_png_is_refused_from_its_header():
    where = "data.image_column: row 3 of shapes.jsonl: column 'image', image 0: "
    fix = " Fix or drop the row, or map it with data.items_fn."
    assert _decode_image(_png_header(30000, 30000)) == (
        where + "the image has 900,000,000 pixels, more than the limit of 67,108,864 "
        "(8192 x 8192); it is refused before decoding." + fix)
    assert _decode_image(_png_header(9000, 9000)) == (  # under PIL's own limit, over ours
        where + "the image has 9000 x 9000 pixels, more than the limit of 67,108,864 "
        "(8192 x 8192); it is refused before decoding." + fix)


def test_an_image_of_an_extreme_aspect_ratio_is_refused_in_one_line():
    """A 500 x 2 picture reached the user as the processor's ValueError; it is refused with the
    item named, as an image too large is."""
    import io

    from PIL import Image

    def png(width: int, height: int) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (width, height), "red").save(out, format="PNG")
        return out.getvalue()

    where = "data.image_column: row 3 of shapes.jsonl: column 'image', image 0: "
    assert _decode_image(png(500, 2)) == (
        where + "the image is 500 x 2 pixels: its aspect ratio (longest side / shortest side) "
        "must be under 200. Fix or drop the row, or map it with data.items_fn.")
    assert _decode_image(png(2, 400)).startswith(where + "the image is 2 x 400 pixels")
    assert _decode_image(png(398, 2)) == "decoded"  # 199: what the processor takes


VIDEO_MEMORY = """
import resource, sys
from runner.data.media import load_video, sample_indices

# Room for the decoder and the 8 kept frames (22 MB), not for the 240 frames (660 MB).
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (400 << 20), resource.RLIM_INFINITY))
clip = load_video(sys.argv[1])
assert clip.frames.shape == (8, 720, 1280, 3), clip.frames.shape
assert clip.frames_indices == tuple(sample_indices(240)) and clip.total_num_frames == 240
assert abs(float(clip.frames[-1].mean()) - 59) <= 3, clip.frames[-1].mean()
"""


def test_a_long_video_keeps_only_the_frames_it_samples(tmp_path):
    """240 frames of 720p are 660 MB decoded; the clip keeps its 8 sampled frames (22 MB) and
    the decode never holds the rest."""
    import subprocess
    import sys

    import av
    import numpy as np

    path = tmp_path / "long.mp4"
    with av.open(str(path), "w") as out:  # 240 frames of 720p, each of one colour
        stream = out.add_stream("mpeg4", rate=24)
        stream.width, stream.height, stream.pix_fmt = 1280, 720, "yuv420p"
        for i in range(240):
            frame = np.full((720, 1280, 3), 20 + i % 200, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    # Decoded in a process of its own, whose address space leaves no room for every frame.
    done = subprocess.run([sys.executable, "-c", VIDEO_MEMORY, str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_video_of_an_extreme_aspect_ratio_is_refused(tmp_path):
    import av
    import numpy as np

    from runner.data.media import MediaError, load_video

    path = tmp_path / "thin.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 1600, 4, "yuv420p"
        for packet in stream.encode(av.VideoFrame.from_ndarray(
                np.zeros((4, 1600, 3), dtype=np.uint8), format="rgb24")):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with pytest.raises(MediaError, match="the video is 1600 x 4 pixels: its aspect ratio"):
        load_video(str(path))


def test_an_image_path_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "picture.png"
    os.mkfifo(fifo)
    assert _decode_image(str(fifo)) == (
        f"data.image_column: row 3 of shapes.jsonl: column 'image', image 0: {fifo} is a FIFO "
        "(named pipe), not a regular file. Fix or drop the row, or map it with data.items_fn.")


def test_a_video_path_that_is_a_fifo_is_refused(tmp_path):
    import os

    from runner.data.media import MediaError, load_video

    fifo = tmp_path / "clip.mp4"
    os.mkfifo(fifo)
    with pytest.raises(MediaError, match="is a FIFO \\(named pipe\\), not a regular file"):
        load_video(str(fifo))


# --- tar bombs ----------------------------------------------------------------------------------

def _tar(members: dict[str, bytes], tail: bytes = b"") -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buf.getvalue() + tail


SAMPLE = json.dumps(PAIR).encode()
BOMBS = {  # 8 MiB of zeros (a few KB compressed) against a cap of 1 MiB
    "a skipped member": {"a.json": SAMPLE, "zeros.bin": bytes(8 << 20)},
    "a member past the cap": {"a.json": SAMPLE, "b.json": b" " * (2 << 20) + SAMPLE},
    "zeros after the end marker": {"a.json": SAMPLE},
}


@pytest.mark.parametrize("compress", ["bz2", "gz", "xz"])
@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_tar_bomb_is_refused_at_the_total_cap(tmp_path, name, compress):
    import bz2
    import gzip
    import lzma

    from runner.data.pairs import PairKeys, file_pairs

    tail = bytes(8 << 20) if name == "zeros after the end marker" else b""
    raw = _tar(BOMBS[name], tail)
    pack = {"bz2": bz2.compress, "gz": gzip.compress, "xz": lzma.compress}[compress]
    packed = pack(raw)
    assert len(packed) < 64 << 10
    path = tmp_path / f"bomb.tar.{compress}"
    path.write_bytes(packed)
    with pytest.raises(RecipeError) as info:
        file_pairs(str(path), PairKeys(), kind="tar", key="data.tar_path", shuffle=False,
                   split="train", max_total_bytes=1 << 20, max_member_bytes=4 << 20)
    assert _one_line(info.value, path) == (
        "data.tar_path: P decompresses to more than data.tar_max_bytes (1,048,576 bytes); the "
        "archive is refused. Raise data.tar_max_bytes if the archive is meant to be that big.")
    small = tmp_path / f"ok.tar.{compress}"
    small.write_bytes(pack(_tar({"a.json": SAMPLE})))
    assert len(file_pairs(str(small), PairKeys(), kind="tar", key="data.tar_path", shuffle=False,
                          split="train", max_total_bytes=1 << 20)) == 1


def test_tar_max_bytes_reaches_the_reader(tmp_path):
    path = tmp_path / "a.tar"
    path.write_bytes(_tar({"a.json": SAMPLE}))
    with pytest.raises(RecipeError, match="more than data.tar_max_bytes \\(1,000 bytes\\)"):
        build_pair_source(DataConfig(tar_path=str(path), tar_max_bytes=1000, validation=OFF))


# --- a second SIGTERM stops a run as a second Ctrl-C does ---------------------------------------

STUCK_STEP = """
import signal, sys, time
from runner.train.loops.loop import StopRequests
from runner.ui import SilentReporter
try:
    with StopRequests(SilentReporter()):
        if sys.argv[1] == "stuck":  # the step is inside one native call that does not return
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        print("in the step", flush=True)
        time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
"""


@pytest.mark.parametrize("step,signals", [("stuck", ("SIGTERM", "SIGTERM")),
                                          ("stuck", ("SIGINT", "SIGTERM")),
                                          ("responsive", ("SIGTERM", "SIGTERM"))])
def test_a_second_stop_signal_ends_the_run(step, signals):
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", STUCK_STEP, step], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        assert proc.stdout.readline().strip() == "in the step"
        started = time.monotonic()
        for name in signals:
            proc.send_signal(getattr(signal, name))
            time.sleep(0.3)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert time.monotonic() - started < 15
    assert err.splitlines()[-1].startswith("interrupted") and "Traceback" not in err, err


# --- a full disk names the file being written ---------------------------------------------------

class _FullDisk:
    """A file opened on a full disk: opening works, writing fails as the OS fails it (ENOSPC,
    no file named)."""

    def __init__(self, handle) -> None:
        self._handle = handle

    def write(self, text: str) -> int:
        import errno
        import os

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()


def _full_disk_open(monkeypatch, module: str) -> None:
    """``open`` in ``module`` gives files whose writes fail with ENOSPC."""
    import builtins

    monkeypatch.setattr(f"{module}.open", lambda *a, **k: _FullDisk(builtins.open(*a, **k)),
                        raising=False)


NO_SPACE = "No space left on device [errno 28]"


def test_a_full_disk_names_the_resolved_recipe(tmp_path, monkeypatch):
    from runner.errors import RuntimeFailure
    from runner.recipe.resolved import write_resolved
    from runner.recipe.schema import Recipe

    _full_disk_open(monkeypatch, "runner.recipe.resolved")
    path = tmp_path / "run" / "recipe.resolved.toml"
    with pytest.raises(RuntimeFailure) as info:
        write_resolved(Recipe(), path)
    assert str(info.value) == f"policy: cannot write the resolved recipe {path}: {NO_SPACE}"
    assert list(path.parent.iterdir()) == []  # no temporary file left behind


def test_a_full_disk_names_the_run_lock(tmp_path, monkeypatch):
    from runner.errors import RuntimeFailure
    from runner.state.run_folder import RunLock

    _full_disk_open(monkeypatch, "runner.state.run_folder")
    with pytest.raises(RuntimeFailure) as info:
        RunLock.acquire(tmp_path / "run")
    assert str(info.value) == (f"policy: cannot write the run lock {tmp_path / 'run' / 'run.lock'}"
                               f": {NO_SPACE}")
    monkeypatch.undo()
    RunLock.acquire(tmp_path / "run").release()  # the failed attempt holds no lock


def test_a_full_disk_names_the_metrics_file(tmp_path, monkeypatch):
    from runner.errors import RuntimeFailure
    from runner.ui.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    _full_disk_open(monkeypatch, "runner.ui.metrics")
    with pytest.raises(RuntimeFailure) as info:
        log.write({"step": 4})
    assert str(info.value) == (f"policy at step 4: cannot write metrics to "
                               f"{tmp_path / 'metrics.jsonl'}: {NO_SPACE}")


@pytest.mark.parametrize("target,file", [("save_file", "optimizer.safetensors"),
                                         ("open", "metrics.jsonl")])
def test_a_full_disk_names_the_checkpoint_file(two_checkpoints, tmp_path, monkeypatch, target,
                                               file):
    import errno
    import os
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from runner.errors import RuntimeFailure
    from runner.state.checkpoint import WholeState, save_checkpoint
    from runner.state.layout import TrainingState

    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    if target == "open":
        _full_disk_open(monkeypatch, "runner.state.checkpoint")
    else:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr("runner.state.checkpoint.save_file", full)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    with pytest.raises(RuntimeFailure) as info:
        save_checkpoint(root, 3, tokenizer=None,
                        policy=WholeState(model, torch.optim.AdamW(model.parameters())),
                        state=TrainingState(step=3, cursor=None, scheduler={}),
                        metrics_rows=[{"step": 3}])
    assert str(info.value) == (
        f"policy at step 3: cannot write checkpoint {root / 'step-000003'} ({file}): {NO_SPACE}; "
        "the partial checkpoint was removed and earlier checkpoints are untouched")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002"]


def test_a_full_arrow_cache_is_not_blamed_on_the_data(tmp_path, home, monkeypatch):
    import errno
    import os

    import datasets

    from runner.errors import RuntimeFailure

    path = tmp_path / "p.jsonl"
    path.write_bytes(_jsonl(GOOD))

    def full(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:  # as datasets wraps it
            raise RuntimeError("An error occurred while generating the dataset") from exc

    monkeypatch.setattr(datasets, "load_dataset", full)
    with pytest.raises(RuntimeFailure) as info:
        load_local(str(path), "train", key="data.path", split_key="data.split")
    assert str(info.value) == (
        f"data: data.path: cannot write the Arrow copy of {path} under {home / 'datasets'}: "
        f"{NO_SPACE}; free space there, or set POSTTRAIN_HOME to a folder on another disk")


# --- step lines reach a pipe as they are printed ------------------------------------------------

LATE_LINE = """
import sys, time
import runner.cli, runner.launch.worker as worker
def dispatch(*args):
    print("step 1/2", file=sys.stdout)  # no flush: only line buffering sends it now
    time.sleep(60)
    return 0
if sys.argv[1] == "cli":
    runner.cli._dispatch = dispatch
    runner.cli.main(["recipes/grpo-arith.toml"])
else:
    worker.guarded = lambda run, prefix: dispatch()
    worker.main(["payload.json"])
"""


@pytest.mark.parametrize("entry", ["cli", "worker"])
def test_stdout_is_line_buffered_into_a_pipe(entry, repo):
    import os
    import selectors
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()  # the default buffering of a pipe
           if k not in ("POSTTRAIN_DRIVER_PID", "PYTHONUNBUFFERED")}
    proc = subprocess.Popen([sys.executable, "-c", LATE_LINE, entry], stdout=subprocess.PIPE,
                            cwd=repo, env={**env, "PYTHONPATH": str(repo)})
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=30)
        assert ready, "no line arrived within 30 s"
        assert proc.stdout.readline() == b"step 1/2\n"
        assert proc.poll() is None  # it arrived while the process still ran
    finally:
        proc.kill()
        proc.wait(30)


# --- the first things a user meets: overrides of a factory, library chatter ---------------------

def test_an_overridden_factory_is_told_its_kwargs_came_from_the_recipe(run_cli):
    rc, out, err = run_cli("--validate", "recipes/grpo-vl.toml",
                           "data.factory=examples.posttrain_extensions.build_prompt_dataset")
    assert rc == 2, out + err
    assert err.splitlines() == [
        "recipes/grpo-vl.toml: data.factory: examples.posttrain_extensions.build_prompt_dataset: "
        "cannot be called with these arguments: got an unexpected keyword argument 'split'. Its "
        "signature is build_prompt_dataset(count: 'int' = 100) -> 'AdditionPrompts'. "
        "data.factory_kwargs = {'split': 'train', 'count': 1000} came from the recipe (written "
        "for its own data.factory), not from the command line: replace the whole table on the "
        "command line too, data.factory_kwargs={...} with the new factory's arguments, or "
        "data.factory_kwargs={} for none."]
    rc, out, err = run_cli("--validate", "recipes/grpo-vl.toml",  # the table replaced: it binds
                           "data.factory=examples.posttrain_extensions.build_prompt_dataset",
                           "data.factory_kwargs={count = 10}")
    assert rc == 0 and err == "", out + err


def test_a_dpo_factory_over_the_built_in_pairs_says_how_to_turn_them_off(run_cli):
    rc, out, err = run_cli("--validate-manifest", "recipes/dpo-arith.toml",
                           "data.factory=examples.posttrain_extensions.build_preference_dataset")
    assert rc == 2, out + err
    assert err.splitlines() == [
        "command line: data.factory: a DPO factory cannot be combined with data.synthetic_pairs "
        "(got {'data.factory': 'examples.posttrain_extensions.build_preference_dataset'}). Use "
        "either the factory or one built-in preference source; to train on the factory, turn "
        "the built-in source off: data.synthetic_pairs=0 on the command line (or remove it from "
        "the recipe)."]
    rc, out, err = run_cli("--validate-manifest", "recipes/dpo-arith.toml",
                           "data.factory=examples.posttrain_extensions.build_preference_dataset",
                           "data.synthetic_pairs=0")
    assert rc == 0, out + err


def test_datasets_prints_nothing_before_the_one_line_error(tmp_path, repo):
    """No "Generating train split" bar, no "Failed to load JSON" log: stderr holds only the
    runner's line (the quiet settings are the runner's, not the environment's)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "p.jsonl"
    path.write_bytes(_jsonl(GOOD) + b'{"prompt": "2 + 2 =", "answer": \n')
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_DATASETS_", "DATASETS_", "TQDM_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "runner.cli", "--dry-run", "--plain", "recipes/grpo-arith.toml",
         f"data.path={path}", "data.validation.enabled=false"], cwd=repo, capture_output=True,
        text=True, timeout=300,
        env={**env, "PYTHONPATH": str(repo), "POSTTRAIN_HOME": str(tmp_path / "home"),
             "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"data.path: {path} line 2: not valid JSON (Expecting value at column 33). Write one "
        "JSON object per line."]


# --- prompts longer than the engine holds (rollout.max_model_len) -------------------------------

def test_max_model_len_must_leave_room_for_the_completion(run_cli):
    rc, out, err = run_cli("--validate-manifest", "recipes/grpo-arith.toml",
                           "rollout.max_model_len=6")
    assert rc == 2, out + err
    assert err.splitlines() == [
        "command line: rollout.max_model_len: must be 0 (derived) or more than the most new "
        "tokens of a completion (6) (got 6)."]


def test_max_model_len_beyond_the_models_context_is_refused(run_cli):
    rc, out, err = run_cli("--dry-run", "--plain", "recipes/grpo-arith.toml",
                           "rollout.max_model_len=300")
    assert rc == 2, out + err
    assert err.splitlines() == [
        "rollout.max_model_len: is longer than the model's context (256, max_position_embeddings "
        "of its config.json) (got 300). Set at most 256, or 0 to derive it."]


def test_a_derived_max_model_len_covers_the_longest_prompt_within_the_context():
    from runner.models import resolve_model_path
    from runner.recipe.schema import Recipe
    from runner.rollout.lengths import derived_limit

    path = resolve_model_path("builtin:tiny-arith")  # max_position_embeddings 256
    recipe = Recipe()  # max_new_tokens 16
    assert derived_limit(recipe, path, [10, 50]).max_model_len == 128  # 66 rounded up to 64s
    assert derived_limit(recipe, path, [48]).max_model_len == 64
    assert derived_limit(recipe, path, []).max_model_len == 64
    capped = derived_limit(recipe, path, [250])
    assert (capped.max_model_len, capped.why) == (256, "the model's context")


@pytest.mark.parametrize("engine,expected", [("hf", "256 (the model's context)"),
                                             ("vllm", "64 (rollout.max_model_len derived")])
def test_the_dry_run_shows_the_engines_max_model_len(run_cli, engine, expected, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    rc, out, err = run_cli("--dry-run", "--plain", "recipes/grpo-arith.toml",
                           f"rollout.engine={engine}")
    assert rc == 0, out + err
    row = next(line for line in out.splitlines() if "rollout max_model_len" in line)
    assert expected in row, row


def _long_prompt_file(tmp_path: Path, prompt: str) -> Path:
    path = tmp_path / "long.jsonl"
    path.write_bytes(_jsonl(GOOD, {"prompt": prompt, "answer": "3"}, GOOD))
    return path


LONG_ARGS = ("data.prompt_column=prompt", "data.response_column=answer",
             "data.validation.enabled=false", "rollout.max_model_len=32")  # 26 prompt tokens


def test_a_prompt_too_long_in_characters_is_refused_before_tokenising(run_cli, tmp_path,
                                                                      monkeypatch):
    from runner.packers.decoder_only import DecoderOnlyLLMDataPacker

    def never(self, item):
        raise AssertionError(f"a {len(item.prompt)}-character prompt was rendered")

    path = _long_prompt_file(tmp_path, "1 + " * 100)  # 400 characters
    real = DecoderOnlyLLMDataPacker.get_rollout_input
    monkeypatch.setattr(DecoderOnlyLLMDataPacker, "get_rollout_input",
                        lambda self, item: never(self, item) if len(str(item.prompt)) > 300
                        else real(self, item))
    rc, out, err = run_cli("--dry-run", "--plain", "recipes/grpo-arith.toml", f"data.path={path}",
                           *LONG_ARGS)
    assert rc == 2, out + err
    assert err.splitlines() == [
        f"data.prompt_column: row 1 of {path}: column 'prompt' is 400 characters long, more "
        "than the 338 that 26 tokens can spell (13 characters per token at most; max_model_len "
        "32 (rollout.max_model_len) less 6 new tokens); it is refused before tokenising. Shorten "
        "or drop the row, or reshape rows with data.items_fn; or raise rollout.max_model_len."]


def test_a_prompt_too_long_in_tokens_is_refused_before_the_run(run_cli, tmp_path):
    import re

    path = _long_prompt_file(tmp_path, "1 + " * 20)  # 80 characters, more than 26 tokens
    rc, out, err = run_cli("--plain", "recipes/grpo-arith.toml", f"data.path={path}",
                           f"run.output_dir={tmp_path / 'run'}", "run.max_steps=1", *LONG_ARGS)
    assert rc == 2, out + err
    assert len(err.splitlines()) == 1, err
    assert re.fullmatch(
        f"data.prompt_column: row 1 of {re.escape(str(path))}: column 'prompt' is \\d+ tokens "
        "long, more than the 26 a prompt may have \\(max_model_len 32 \\(rollout.max_model_len\\) "
        "less 6 new tokens\\). Shorten or drop the row, or reshape rows with data.items_fn; or "
        "raise rollout.max_model_len.", err.strip()), err
    assert not (tmp_path / "run" / "checkpoints").exists()


class _NoPacker:
    """A packer that must not be asked to render: the prompt is refused before."""

    def __init__(self, ids: int = 0) -> None:
        self.ids = ids

    def get_rollout_input(self, item):
        if not self.ids:
            raise AssertionError("rendered a prompt that should have been refused")
        return item.prompt

    def engine_prompt(self, rollout_input):
        from runner.packers.base import EnginePrompt

        return EnginePrompt(tuple(range(self.ids)))


@pytest.mark.parametrize("ids,chars,expected", [
    (0, 200, "is 200 characters long, more than the 112 that 56 tokens can spell (2 characters "
     "per token at most; max_model_len 64 (rollout.max_model_len) less 8 new tokens); it is "
     "refused before tokenising"),
    (57, 40, "is 57 tokens long, more than the 56 a prompt may have (max_model_len 64 "
     "(rollout.max_model_len) less 8 new tokens)"),
])
def test_a_drawn_prompt_that_does_not_fit_is_refused_naming_its_row(ids, chars, expected):
    from runner.rollout.base import SamplingConfig
    from runner.rollout.lengths import PromptLimit
    from runner.train.roles import Rollout
    from runner.types import MediaOrigin, ObsBundle

    class Engine:
        def generate(self, *args):
            raise AssertionError("the engine got a prompt that does not fit")

    item = ObsBundle("x" * chars, origin=MediaOrigin("row 7 of build_rows()", prompt_column="q"))
    rollout = Rollout(Engine(), _NoPacker(ids), PromptLimit(64, "rollout.max_model_len", 2))
    with pytest.raises(RecipeError) as info:
        rollout.generate([item], SamplingConfig(n=2, max_new_tokens=8))
    assert info.value.lines() == [
        f"data.prompt_column: row 7 of build_rows(): column 'q' {expected}. Shorten or drop the "
        "row, or reshape rows with data.items_fn; or raise rollout.max_model_len."]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_the_engines_get_max_model_len(engine, monkeypatch):
    import attrs

    from runner.models import resolve_model_path
    from runner.recipe.schema import Recipe
    from runner.rollout.factory import make_engine

    recipe = Recipe()
    recipe = attrs.evolve(recipe, rollout=attrs.evolve(recipe.rollout, engine=engine))
    path = resolve_model_path("builtin:tiny-arith")
    if engine == "vllm":
        import runner.rollout.vllm as vllm_engine

        got = {}
        monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda path, **kw: got.update(kw) or got)
        make_engine(recipe, path, dtype="float32", max_model_len=96)
        assert got["max_model_len"] == 96
        return
    from runner.errors import RunnerError
    from runner.rollout.base import SamplingConfig

    hf = make_engine(recipe, path, dtype="float32", max_model_len=20)
    assert hf.max_model_len == 20
    with pytest.raises(RunnerError, match="prompt 0 has 15 tokens; with 6 new tokens it exceeds "
                       "the hf engine's max_model_len \\(20\\)"):
        hf.generate([list(range(1, 16))], SamplingConfig(n=1, max_new_tokens=6))


# --- a rank that dies or stops: one line from the driver, tracebacks in the run folder ----------

def test_a_rank_error_none_of_the_projects_goes_to_a_file_not_the_terminal(tmp_path, capsys):
    from runner.launch.worker import EXIT_TRACEBACK, logged, traceback_path

    def broken() -> int:
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")

    path = traceback_path(tmp_path / "run", 0)
    assert logged(broken, path) == EXIT_TRACEBACK
    assert capsys.readouterr() == ("", "")
    text = path.read_text()
    assert text.startswith("Traceback") and text.rstrip().endswith(
        "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242")
    with pytest.raises(RecipeError):  # the project's own errors are rendered as before
        logged(lambda: (_ for _ in ()).throw(RecipeError([])), path)


def _fake_ranks(tmp_path: Path, rank0_exits_after: float):
    import subprocess
    import sys

    from runner.launch.torchrun import _Ranks
    from runner.launch.worker import traceback_path

    logs = tmp_path / "run" / "logs"
    ranks = _Ranks([], logs, timeout_s=20)
    trace = traceback_path(logs.parent, 0)
    trace.parent.mkdir(parents=True)
    trace.write_text("Traceback (most recent call last):\n  ...\nRuntimeError: [gloo] Timed out "
                     "waiting 20000ms for recv operation to complete\n")
    code = f"import sys, time; time.sleep({rank0_exits_after}); sys.exit(3)"
    for argv in ([sys.executable, "-c", code], [sys.executable, "-c", "import time; "
                                                "time.sleep(60)"]):
        ranks.procs.append(subprocess.Popen(argv, start_new_session=True))
    return ranks, trace


RESUME = "The latest complete checkpoint is intact: run the same command again to resume"


def test_a_stopped_rank_is_named_not_the_rank_that_waited_for_it(tmp_path):
    import os
    import signal

    from runner.errors import RunnerError

    ranks, trace = _fake_ranks(tmp_path, 0.5)
    os.kill(ranks.procs[1].pid, signal.SIGSTOP)
    try:
        with pytest.raises(RunnerError) as info:
            ranks.watch()
    finally:
        ranks.kill()
    assert str(info.value) == (
        f"rank 1 (pid {ranks.procs[1].pid}) stopped answering (its process is stopped, e.g. by "
        "SIGSTOP): rank 0 waited for it in a collective for up to launch.collective_timeout_s = "
        "20 s, then failed with RuntimeError: [gloo] Timed out waiting 20000ms for recv "
        f"operation to complete (traceback: {trace}); the ranks were stopped. {RESUME}")


def test_a_dead_rank_is_named_and_the_survivors_tracebacks_are_in_files(tmp_path):
    import os
    import signal

    from runner.errors import RunnerError

    ranks, trace = _fake_ranks(tmp_path, 1.0)
    os.kill(ranks.procs[1].pid, signal.SIGKILL)
    try:
        with pytest.raises(RunnerError) as info:
            ranks.watch()
    finally:
        ranks.kill()
    assert ranks.procs[0].returncode == 3  # it failed on its own within the grace period
    assert str(info.value) == (
        f"rank 1 (pid {ranks.procs[1].pid}) was killed by SIGKILL; the other ranks were stopped "
        f"(their tracebacks: {trace}). {RESUME}")


def test_a_rank_killed_by_a_signal_is_named_before_a_peer_that_failed_after_it(tmp_path):
    """Both ranks already ended when the driver first looks: rank 1 killed by SIGKILL, rank 0
    failed with a traceback (its collective broke). The line names rank 1, the cause."""
    import os
    import signal
    import time

    from runner.errors import RunnerError

    ranks, _ = _fake_ranks(tmp_path, 0.0)
    os.kill(ranks.procs[1].pid, signal.SIGKILL)
    while any(p.poll() is None for p in ranks.procs):
        time.sleep(0.05)
    with pytest.raises(RunnerError) as info:
        ranks.watch()
    assert str(info.value).startswith(f"rank 1 (pid {ranks.procs[1].pid}) was killed by SIGKILL; "
                                      "the other ranks were stopped"), str(info.value)


# --- user code that leaves the process: never exit 0, the rank named -------------------------

from tests.conftest import REPO  # noqa: E402

EXIT_RESUME = ("before the run finished: the run did not complete (the latest complete "
               "checkpoint is intact; run the same command again to resume)")


def test_os_exit_zero_under_the_guard_leaves_with_one_and_names_the_caller(tmp_path):
    """A process inside ``exit_guard`` that calls os._exit(0) exits 1 with one line naming the
    caller's file and line; os._exit(5) keeps its code; a forked child keeps the real os._exit."""
    import subprocess
    import sys

    script = tmp_path / "leaves.py"
    script.write_text(
        "import os, sys\n"
        "from runner.launch.exits import exit_guard\n"
        "with exit_guard('rank 1: '):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os._exit(7)\n"
        "    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7\n"
        "    os._exit(int(sys.argv[1]))\n")
    for code, expected in ((0, 1), (5, 5)):
        done = subprocess.run([sys.executable, str(script), str(code)], capture_output=True,
                              text=True, timeout=60, cwd=REPO)
        assert done.returncode == expected, done.stderr
        assert done.stderr.strip() == (f"rank 1: error: os._exit({code}) was called by {script}:8 "
                                       f"{EXIT_RESUME}")


def test_sys_exit_inside_the_run_is_a_failure_naming_where(capsys):
    import sys

    from runner.launch.entry import guarded

    def body() -> int:
        sys.exit(0)

    line = body.__code__.co_firstlineno + 1
    assert guarded(body) == 1
    assert capsys.readouterr().err.strip() == (
        f"error: sys.exit(0) was called by {__file__}:{line} {EXIT_RESUME}")

    def fails() -> int:
        sys.exit(4)

    assert guarded(fails, "rank 0: ") == 4
    assert capsys.readouterr().err.startswith("rank 0: error: sys.exit(4) was called by ")


@pytest.mark.parametrize("timeout_s", [0.0, 30.0])
def test_a_reward_that_calls_sys_exit_is_named(timeout_s):
    """In the calling thread (one function, no deadline) and in a reward thread alike."""
    from runner.rewards.calls import RewardFailure, call_all
    from tests.extmods.callables import exits

    with pytest.raises(RewardFailure, match=r"exits.*raised SystemExit: 0"):
        call_all(["exits"], [exits], ["1", "2"], [None, None], timeout_s=timeout_s, step=3)


EXITING = ("recipes/grpo-arith.toml", "env.factory=tests.extmods.envs.exits_in_step",
           "reward.functions=[]", "algo.prompts_per_step=2", "algo.group_size=2",
           "data.validation.enabled=false", "run.max_steps=2")


def test_an_environment_calling_os_exit_zero_fails_the_run(tmp_path):
    from tests.multiproc import run_ranks

    done = run_ranks(EXITING[0], tmp_path / "run", 1, *EXITING[1:])
    assert done.returncode == 1, done.stderr
    envs = REPO / "tests/extmods/envs.py"
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: os._exit(0) was called by {envs}:"), last
    assert last.endswith(EXIT_RESUME)
    assert not (tmp_path / "run/checkpoints").exists() or not any(
        (tmp_path / "run/checkpoints").iterdir())


@pytest.mark.multiproc
def test_a_rank_that_calls_os_exit_zero_is_named_under_torchrun(tmp_path):
    """Rank 1's environment leaves with os._exit(0): rank 1 says so, and the driver's line
    blames rank 1, not rank 0 whose collective broke."""
    from tests.multiproc import run_ranks

    done = run_ranks(EXITING[0], tmp_path / "run", 2, *EXITING[1:], "env.factory_kwargs={rank=1}")
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert any(line.startswith("rank 1: error: os._exit(0) was called by ") for line in lines), \
        done.stderr
    assert lines[-1].startswith("error: rank 1 (pid "), lines[-1]
    assert "exited with code 1" in lines[-1]
