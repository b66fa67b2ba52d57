"""Experiment trackers (logging.report_to): what W&B, MLflow and TensorBoard hold, read back with
each library's own reader, equals metrics.jsonl; a resumed run continues the same tracker runs
without logging a step twice; a tracker whose server dies mid-run costs one warning line, never
the run; bad input is a one-line recipe error."""

from __future__ import annotations

import json
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runner.errors import RecipeError
from runner.recipe import recipe_from_mapping
from runner.recipe.checks import trackers_of
from runner.ui import trackers as tr
from tests import forkserver
from tests.conftest import REPO
from tests.resume_helpers import CLI, _env, rows

GRPO = "recipes/grpo-arith.toml"
SMALL = ("algo.prompts_per_step=4", "algo.group_size=4", "rollout.max_new_tokens=4",
         "data.validation.size=8", "train.eval_every=2", "logging.sample_every=0",
         "run.name=tracked", "logging.project=trackers-test")
ALL = 'logging.report_to=["jsonl", "wandb", "mlflow", "tensorboard"]'


def tracker_env(**extra: str) -> dict[str, str]:
    """The CLI's environment, W&B offline and nothing sent anywhere whatever the shell says."""
    env = {k: v for k, v in _env().items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    return {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
            "WANDB_ERROR_REPORTING": "false", "MLFLOW_DISABLE_TELEMETRY": "true", **extra}


def run(out: Path, *overrides: str, env: dict[str, str] | None = None):
    return forkserver.run([*CLI, GRPO, f"run.output_dir={out}", *SMALL, *overrides], cwd=REPO,
                          env=env or tracker_env(), timeout=300)


def numeric(row: dict) -> dict:
    return tr.numbers(row)


# --- readers: each library's own records ----------------------------------------------------------

def wandb_records(path: Path):
    """The records of a W&B run file (``run-<id>.wandb``), decoded with wandb's own protobuf
    classes. The installed wandb (0.31) has no Python reader of these files any more (its
    service, written in Go, reads and writes them), so the framing is read here: a 7-byte header
    (':W&B', magic 0xBEE1, version), then records in 32 KiB blocks, each chunk with a 7-byte
    header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(out: Path, run_id: str) -> tuple[list[tuple[int, dict]], list, dict]:
    """(step, values) of every history record of run ``run_id`` in start order, its run
    records and its config (the last value of every key)."""
    history, runs, config = [], [], {}
    folders = sorted(out.glob(f"wandb/offline-run-*-{run_id}"))
    assert folders, list(out.glob("wandb/*"))
    for folder in folders:
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                history.append((items["_step"],
                                {k: v for k, v in items.items() if not k.startswith("_")}))
            elif kind == "run":
                runs.append(record.run)
                updates = record.run.config.update
            elif kind == "config":
                updates = record.config.update
            if kind in ("run", "config"):
                config.update({u.key: json.loads(u.value_json) for u in updates if u.key})
    return history, runs, config


def local_mlflow_store(out: Path, monkeypatch) -> str:
    """The runner's local MLflow store of run folder ``out``, made the tracking URI here."""
    uri = (out / "mlruns").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's file store, as the run
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return uri


def expected_rows(before: list[dict], after: list[dict], through: int) -> list[dict]:
    """What a tracker holds after a resume: the first run's rows through the step it had
    logged, the resumed run's rows after it."""
    return [r for r in before if r["step"] <= through] + [r for r in after if r["step"] > through]


# --- a run, killed after logging a step its checkpoint does not have, then resumed -------------

@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Steps 0-3 to every tracker with checkpoints at 2 and 3; checkpoint 3 is removed (as if
    the run was killed before writing it), then the run resumes from 2 to step 4."""
    out = tmp_path_factory.mktemp("tracked")
    first = run(out, ALL, "run.max_steps=3", "checkpoint.every_steps=2")
    assert first.returncode == 0, first.stdout + first.stderr
    before = rows(out)
    ckpts = out / "checkpoints"
    first_ids = json.loads((ckpts / "step-000003" / "state.json").read_text())["trackers"]
    shutil.rmtree(ckpts / "step-000003")
    (ckpts / "latest").write_text("step-000002")
    second = run(out, ALL, "run.max_steps=4", "checkpoint.every_steps=2")
    assert second.returncode == 0, second.stdout + second.stderr
    state = json.loads((ckpts / "step-000004" / "state.json").read_text())
    return {"out": out, "before": before, "after": rows(out), "first_ids": first_ids,
            "ids": state["trackers"], "outputs": (first, second)}


def test_the_runs_say_where_the_tracker_runs_are_and_the_checkpoint_keeps_their_ids(resumed):
    ids = resumed["ids"]
    assert set(ids) == {"wandb", "mlflow", "tensorboard"}
    assert ids == resumed["first_ids"]  # the resumed run continued the same tracker runs
    for done in resumed["outputs"]:
        assert "warning" not in done.stdout + done.stderr, done.stdout + done.stderr
        assert f"W&B: offline run {ids['wandb']}" in done.stdout
        assert f"MLflow: run {ids['mlflow']} of experiment trackers-test" in done.stdout
    progress = json.loads((resumed["out"] / tr.PROGRESS_FILE).read_text())
    assert progress == {name: {"id": ids[name], "step": 4} for name in ids}
    assert [r["step"] for r in resumed["after"]] == [0, 1, 2, 3, 4]


def test_wandb_offline_run_holds_every_step_once_with_the_values_of_metrics_jsonl(resumed):
    out, run_id = resumed["out"], resumed["ids"]["wandb"]
    history, runs, config = wandb_history(out, run_id)
    assert len(runs) == 2  # the first run and its resume, one run id
    assert {(r.run_id, r.project, r.display_name) for r in runs} == {
        (run_id, "trackers-test", "tracked")}
    steps = [step for step, _ in history]
    assert steps == [0, 1, 2, 3, 4]  # step 3 (logged before the kill) is not logged again
    want = expected_rows(resumed["before"], resumed["after"], through=3)
    assert [values for _, values in history] == [numeric(r) for r in want]
    # the resolved recipe is the run's config (the resumed one: it extended run.max_steps)
    assert config["run"]["name"] == "tracked" and config["run"]["max_steps"] == 4
    assert config["logging"]["report_to"] == ["jsonl", "wandb", "mlflow", "tensorboard"]
    assert len(config["resolved"]["recipe_hash"]) == 64


def test_mlflow_local_store_holds_every_step_once_with_the_values_of_metrics_jsonl(
        resumed, monkeypatch):
    out, run_id = resumed["out"], resumed["ids"]["mlflow"]
    local_mlflow_store(out, monkeypatch)
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient()
    found = mlflow.search_runs(experiment_names=["trackers-test"], output_format="list")
    assert [r.info.run_id for r in found] == [run_id]  # the resume continued the same run
    assert found[0].info.run_name == "tracked" and found[0].info.status == "FINISHED"
    want = expected_rows(resumed["before"], resumed["after"], through=3)
    keys = sorted({k for r in want for k in numeric(r)})
    for key in keys:
        history = client.get_metric_history(run_id, tr.mlflow_key(key, file_store=True))
        assert [(m.step, m.value) for m in history] == [
            (r["step"], float(r[key])) for r in want if key in r], key
    assert set(found[0].data.metrics) == {tr.mlflow_key(k, file_store=True) for k in keys}
    params = found[0].data.params
    assert params["run.name"] == "tracked" and params["logging.project"] == "trackers-test"
    assert params["run.max_steps"] == "3"  # MLflow parameters cannot change; the first is kept
    assert len(params["resolved.recipe_hash"]) == 64


def test_tensorboard_holds_every_step_once_with_the_values_of_metrics_jsonl(resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(resumed["out"] / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    want = expected_rows(resumed["before"], resumed["after"], through=3)
    keys = sorted({k for r in want for k in numeric(r)})
    assert sorted(events.Tags()["scalars"]) == keys
    for key in keys:  # TensorBoard keeps float32
        got = [(e.step, e.value) for e in sorted(events.Scalars(key), key=lambda e: e.wall_time)]
        assert got == [(r["step"], float(np.float32(r[key]))) for r in want if key in r], key


# --- a tracking server that dies mid-run --------------------------------------------------------

def test_a_tracking_server_killed_mid_run_costs_one_warning_line_not_the_run(tmp_path):
    """The server dies while it handles the run's second metrics batch (step 1): the run ends
    with exit 0, one warning line, and metrics.jsonl complete; what the server took before it
    died is what metrics.jsonl says."""
    folder, out = tmp_path / "server", tmp_path / "run"
    folder.mkdir()
    server = subprocess.Popen([sys.executable, "-m", "tests.mlflow_stub", str(folder), "2"],
                              cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    proc = None
    try:
        deadline = time.monotonic() + 60
        while not (folder / "port").exists():
            assert server.poll() is None and time.monotonic() < deadline, "no server"
            time.sleep(0.02)
        uri = f"http://127.0.0.1:{(folder / 'port').read_text()}"
        env = tracker_env(MLFLOW_TRACKING_URI=uri, MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="0")
        proc = forkserver.popen([*CLI, GRPO, f"run.output_dir={out}", *SMALL,
                                 'logging.report_to=["mlflow"]', "run.max_steps=3"],
                                cwd=REPO, env=env)
        while not (folder / "held").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline + 240, "the run never reached the server"
            time.sleep(0.02)
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        output = proc.communicate(timeout=300)[0]
    finally:
        for p in (server, proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
    assert proc.returncode == 0, output
    warnings = [line for line in output.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1, output
    assert warnings[0].startswith("warning: MLflow stopped logging at step 1 ("), warnings
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3]
    taken = [json.loads(line) for line in (folder / "batches.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows(out)}
    assert [b["step"] for b in taken] == [[0], [1]]
    for batch in taken:  # a server gets the keys as they are, but "@" (MLflow refuses it)
        assert batch["metrics"] == {tr.mlflow_key(k, file_store=False): float(v) for k, v in
                                    numeric(by_step[batch["step"][0]]).items()}


# --- recipe errors, the deprecated flag, the fan-out's rules ------------------------------------

def test_an_unknown_tracker_is_a_one_line_recipe_error(tmp_path):
    done = forkserver.run([*CLI, GRPO, f"run.output_dir={tmp_path}",
                           'logging.report_to=["jsonl", "neptune"]'], cwd=REPO,
                          env=tracker_env(), timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "logging.report_to[1]: not a valid choice (got 'neptune')" in done.stderr
    assert "'jsonl', 'tensorboard', 'wandb', 'mlflow'" in done.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_missing_tracker_library_is_a_one_line_recipe_error(monkeypatch):
    import importlib.util

    from runner import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard")
                        else real(name, *a))
    recipe = recipe_from_mapping({"logging": {"report_to": ["jsonl", "wandb"],
                                              "tensorboard": True}})
    problems = preflight.validate_trackers(recipe)
    lines = [p.render("r.toml") for p in problems]
    assert lines == [
        "r.toml: logging.report_to: 'wandb' needs the wandb package, which is not installed "
        "(got ['jsonl', 'wandb']). Pip install -e '.[wandb]' (make setup installs it), or "
        "remove 'wandb' from logging.report_to.",
        "r.toml: logging.tensorboard: 'tensorboard' needs the tensorboard package, which is not "
        "installed (got True). Pip install -e '.[tensorboard]' (make setup installs it), or set "
        "logging.tensorboard = false."]


def test_report_to_and_the_deprecated_tensorboard_flag():
    def names(**logging):
        return trackers_of(recipe_from_mapping({"logging": logging}).logging)

    assert names() == ()  # jsonl alone: metrics.jsonl is always written
    assert names(report_to=["wandb"]) == ("wandb",)
    assert names(tensorboard=True) == ("tensorboard",)
    assert names(report_to=["mlflow", "tensorboard", "mlflow"], tensorboard=True) == (
        "mlflow", "tensorboard")
    with pytest.raises(RecipeError) as err:
        recipe_from_mapping({"logging": {"report_to": ["wandb"], "project": "a/b"}})
    assert err.value.problems[0].key == "logging.project"
    with pytest.raises(RecipeError):
        recipe_from_mapping({"logging": {"report_to": ["mlflow"], "project": " "}})


class Fake:
    """A tracker that records what it gets and fails where told."""

    instances: list[Fake] = []

    def __init__(self, name: str, setup, resume_id, say, fail_start=False, fail_at=None):
        if fail_start:
            raise ConnectionError("refused\nsecond line")
        self.name, self.run_id, self.resumed = name, resume_id or f"{name}-new", bool(resume_id)
        self.fail_at, self.logged, self.closed = fail_at, [], None
        Fake.instances.append(self)

    def log(self, values, step):
        if step == self.fail_at:
            raise OSError("gone")
        self.logged.append((step, values))

    def close(self, outcome):
        self.closed = outcome


def fakes(monkeypatch, **options):
    Fake.instances = []
    starters = {name: (lambda s, r, say, name=name: Fake(name, s, r, say, **options.get(name, {})))
                for name in ("a", "b", "c")}
    monkeypatch.setattr(tr, "STARTERS", starters)
    monkeypatch.setattr(tr, "LABELS", {"a": "A", "b": "B", "c": "C"})


def test_the_fan_out_warns_once_per_tracker_and_never_logs_a_step_twice(tmp_path, monkeypatch):
    fakes(monkeypatch, b={"fail_at": 2}, c={"fail_start": True})
    said: list[str] = []
    setup = tr.TrackerSetup(tmp_path, "r", "p", {})
    trackers = tr.Trackers(("a", "b", "c"), setup, resume=None, rows=[], say=said.append)
    for step in (0, 1, 1, 2, 3):  # step 1 twice: logged once
        trackers.log({"step": step, "loss": step / 2, "ids": [1, 2], "flag": True, "s": "x"})
    trackers.close("stopped")
    a, b = Fake.instances
    assert a.logged == [(0, {"loss": 0.0}), (1, {"loss": 0.5}), (2, {"loss": 1.0}),
                        (3, {"loss": 1.5})]
    assert b.logged == a.logged[:2] and b.closed is None and a.closed == "stopped"
    assert said == [
        "warning: C did not start (ConnectionError: refused\\x0asecond line); the run goes on "
        "without it and metrics.jsonl has every row",
        "warning: B stopped logging at step 2 (OSError: gone); the run goes on without it and "
        "metrics.jsonl has every row"]
    assert trackers.ids == {"a": "a-new", "b": "b-new"}
    assert json.loads((tmp_path / tr.PROGRESS_FILE).read_text()) == {
        "a": {"id": "a-new", "step": 3}, "b": {"id": "b-new", "step": 1}}


def test_a_resume_skips_what_the_tracker_runs_have_and_fills_a_new_one(tmp_path, monkeypatch):
    fakes(monkeypatch)
    (tmp_path / tr.PROGRESS_FILE).write_text(json.dumps(
        {"a": {"id": "a-7", "step": 5}, "b": {"id": "b-other", "step": 9}}))
    restored = [{"step": s, "loss": float(s)} for s in range(4)]  # the checkpoint of step 3
    trackers = tr.Trackers(("a", "b", "c"), tr.TrackerSetup(tmp_path, "r", "p", {}),
                           resume={"a": "a-7", "b": "b-1"}, rows=restored, say=print)
    for step in range(4, 8):
        trackers.log({"step": step, "loss": float(step)})
    a, b, c = Fake.instances
    assert a.run_id == "a-7" and [s for s, _ in a.logged] == [6, 7]  # it had 4 and 5
    assert b.run_id == "b-1" and [s for s, _ in b.logged] == [4, 5, 6, 7]  # not its record
    assert c.run_id == "c-new" and [s for s, _ in c.logged] == list(range(8))  # filled first
    assert trackers.ids == {"a": "a-7", "b": "b-1", "c": "c-new"}


def test_mlflow_resume_keeps_the_first_parameters_and_a_lost_run_starts_anew(
        tmp_path, monkeypatch):
    for name, value in (("MLFLOW_DISABLE_TELEMETRY", "true"), ("MLFLOW_ALLOW_FILE_STORE", "true"),
                        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"),
                        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")):
        monkeypatch.setenv(name, value)  # the tracker's defaults, undone after the test
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    said: list[str] = []

    def start(resume_id, max_steps):
        config = {"run": {"name": "r", "max_steps": max_steps}, "data": {"factory_kwargs": {
            "a b": [1, 2]}}}
        return tr.MlflowTracker(tr.TrackerSetup(tmp_path, "r", "p", config), resume_id,
                                said.append)

    first = start(None, 3)
    first.log({"eval/reward": 0.5, "eval/reward/x": 0.25}, 0)
    first.close("stopped")
    again = start(first.run_id, 9)
    again.log({"eval/reward": 0.75}, 1)
    again.close("finished")
    assert again.resumed and again.run_id == first.run_id
    run = again._client.get_run(first.run_id)
    assert run.data.params == {"run.name": "r", "run.max_steps": "3",
                               "data.factory_kwargs": '{"a b": [1, 2]}'}
    assert run.info.status == "FINISHED"
    history = again._client.get_metric_history(first.run_id, "eval.reward")
    assert [(m.step, m.value) for m in history] == [(0, 0.5), (1, 0.75)]
    lost = start("0123456789abcdef0123456789abcdef", 3)
    assert not lost.resumed and lost.run_id not in ("", first.run_id)
    assert said[-2] == (f"MLflow: run 0123456789abcdef0123456789abcdef of the checkpoint is not "
                        f"in {(tmp_path / 'mlruns').resolve().as_uri()}; starting a new run with "
                        "the checkpoint's rows")
    lost.close("failed")
    assert lost._client.get_run(lost.run_id).info.status == "FAILED"


_W_AND_B_ALONE = """
import json, os, sys
from pathlib import Path
from runner.ui.trackers import TrackerSetup, WandbTracker
out = Path(sys.argv[1])
tracker = WandbTracker(TrackerSetup(out, "r", "p", {}), None, lambda line: None)
tracker.log({"a": 1.0}, 1)
tracker.close("finished")
print(json.dumps(os.environ.get("WANDB_CACHE_DIR")))
"""


def test_wandb_writes_nothing_outside_the_run_folder(tmp_path):
    """W&B's service logs (core-debug-*.log) went to the user's cache folder; they go under
    <output_dir>/wandb/, and the process's environment is as it was after the start."""
    home, out = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    env = {k: v for k, v in tracker_env().items()
           if not k.startswith(("XDG_", "WANDB_CACHE", "WANDB_CONFIG", "WANDB_DATA"))}
    env["HOME"] = str(home)
    done = subprocess.run([sys.executable, "-c", _W_AND_B_ALONE, str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "null"  # not left set in the process
    assert [p for p in home.rglob("*") if p.is_file()] == []
    logs = sorted(p.name.split("-")[0] for p in (out / "wandb").rglob("*-debug-*.log"))
    assert "core" in logs, sorted(out.rglob("*"))
