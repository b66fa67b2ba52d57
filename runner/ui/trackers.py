"""Experiment trackers: where rank 0's metrics rows go besides metrics.jsonl (logging.report_to).

Each tracker is a small object: its ``name``, the ``run_id`` a resumed run continues (kept in
the checkpoint), whether it ``resumed`` that run, ``log(values, step)`` and ``close(outcome)``.
``Trackers`` starts the ones a recipe names and fans each row out to them:

- a tracker that fails to start or to log is reported in one line and dropped; the run goes on
  and metrics.jsonl keeps every row;
- only numbers are logged (``time/`` and ``perf/`` keys included), each row at its ``step``;
- a tracker never gets a step twice. ``trackers.json`` in the run folder records, after each
  row, the last step every tracker took. A resumed run continues the tracker runs its checkpoint
  names and skips the steps they already have: those a killed run logged after its checkpoint
  stay as that run logged them (a resume is exact on CPU, so only the wall-clock keys differ;
  metrics.jsonl holds the resumed run's rows). A tracker that starts a new run (one added on
  resume, or whose run its store no longer has) first gets the rows the checkpoint carries.

W&B runs offline unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads the run later);
MLflow writes a local store under the run folder unless ``MLFLOW_TRACKING_URI`` is set. Neither
library sends telemetry or error reports unless its own variable asks for them, and MLflow's
HTTP retries are bounded, so a dead server costs seconds, not minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import string
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from runner.errors import safe_line
from runner.recipe.schema import FREEFORM_KEYS
from runner.state.run_folder import RunFolder, no_follow

PROGRESS_FILE = "trackers.json"
LABELS = {"tensorboard": "TensorBoard", "wandb": "W&B", "mlflow": "MLflow"}
_MAX_REASON = 300  # characters of a library's error in the one-line warning


@attrs.frozen
class TrackerSetup:
    """What every tracker run is made from: the run folder, the run's name and project, and
    its config (the resolved recipe as a nested mapping)."""

    output_dir: Path
    run_name: str
    project: str
    config: Mapping[str, Any]


class Tracker(Protocol):
    name: str
    run_id: str  # "" where the tracker has no run id (TensorBoard)
    resumed: bool  # it continues the run of the id it was given

    def log(self, values: dict[str, float], step: int) -> None: ...
    def close(self, outcome: str) -> None: ...


def numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics row, less ``step`` (lists and strings are left out)."""
    return {k: v for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}


# --- TensorBoard --------------------------------------------------------------------------------

class TensorBoardTracker:
    name = "tensorboard"
    run_id = ""

    def __init__(self, setup: TrackerSetup, resume_id: str | None, say: Callable[[str], None]):
        from torch.utils.tensorboard import SummaryWriter

        self.resumed = resume_id is not None
        folder = RunFolder(setup.output_dir).tracker("tensorboard")
        self._writer = SummaryWriter(log_dir=str(folder))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self, outcome: str) -> None:
        self._writer.close()


# --- Weights & Biases ---------------------------------------------------------------------------

_ID_CHARS = string.ascii_lowercase + string.digits  # W&B's run ids: 8 of these
_EXIT_CODES = {"finished": 0, "stopped": 130, "failed": 1}  # the CLI's own exit codes


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` inside the block only (each key is one it did not hold)."""
    os.environ.update(values)
    try:
        yield
    finally:
        for key in values:
            os.environ.pop(key, None)


class WandbTracker:
    name = "wandb"

    def __init__(self, setup: TrackerSetup, resume_id: str | None, say: Callable[[str], None]):
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # read when its service starts
        import wandb

        settings: dict[str, Any] = {"disable_git": True, "x_save_requirements": False}
        if "WANDB_CONSOLE" not in os.environ:
            settings["console"] = "off"  # the runner's own view is no log to capture
        if "WANDB_SILENT" not in os.environ:
            settings["silent"] = True  # the runner says where the run is, in one line
        self.resumed = bool(resume_id)
        self.run_id = resume_id or "".join(secrets.choice(_ID_CHARS) for _ in range(8))
        # W&B's service writes its own logs (core-debug-*.log, symon-debug-*.log) under
        # WANDB_CACHE_DIR, by default the user's cache folder: unless the user chose one, the
        # run folder's wandb/cache/, set for the start of the service alone (it reads the
        # environment once, when it starts) and taken back after.
        folder = RunFolder(setup.output_dir).tracker("wandb")
        cache = {} if "WANDB_CACHE_DIR" in os.environ else {
            "WANDB_CACHE_DIR": str((folder / "cache").resolve())}
        with _environment(cache):
            self._run = wandb.init(
                project=setup.project, name=setup.run_name, id=self.run_id, resume="allow",
                dir=str(setup.output_dir),
                mode=None if os.environ.get("WANDB_MODE") else "offline",
                settings=wandb.Settings(**settings))
        # A resumed run may extend the recipe (run.max_steps): its config is the latest one.
        self._run.config.update(dict(setup.config), allow_val_change=True)
        where = Path(self._run.dir).parent
        if self._run.offline:
            say(f"W&B: offline run {self.run_id} in {where}; upload it later with "
                f"`wandb sync {where.parent}/offline-run-*-{self.run_id}`")
        else:
            say(f"W&B: run {self.run_id} of project {setup.project}")

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self, outcome: str) -> None:
        self._run.finish(exit_code=_EXIT_CODES.get(outcome, 1))


# --- MLflow -------------------------------------------------------------------------------------

_MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
_MLFLOW_BATCH = 1000  # metrics per log_batch request (MLflow's limit)
_MLFLOW_PARAMS = 100  # parameters per log_batch request (MLflow's limit)


class MlflowTracker:
    name = "mlflow"

    def __init__(self, setup: TrackerSetup, resume_id: str | None, say: Callable[[str], None]):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        # MLflow retries a failed request 7 times over about 4 minutes by default.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:  # a local store under the run folder
            uri = RunFolder(setup.output_dir).tracker("mlruns").resolve().as_uri()
        # MLflow's file store keeps a metric as a file named by its key: eval/reward and
        # eval/reward/arithmetic_exact cannot both be there, so it gets the keys with '.' for
        # '/'. MLflow 3 refuses the file store unless asked (it recommends a database store,
        # which needs the full mlflow package and its SQL stack).
        self.file_store = urllib.parse.urlparse(uri).scheme in ("", "file")
        if self.file_store:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException

        self._Metric = Metric
        self._client = client = MlflowClient(tracking_uri=uri)
        self.resumed, self.run_id = False, ""
        if resume_id:
            try:
                known = client.get_run(resume_id).data.params
                self.resumed, self.run_id = True, resume_id
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                say(f"MLflow: run {resume_id} of the checkpoint is not in {uri}; starting a new "
                    "run with the checkpoint's rows")
        if not self.resumed:
            found = client.get_experiment_by_name(setup.project)
            experiment = (found.experiment_id if found is not None
                          else client.create_experiment(setup.project))
            self.run_id = client.create_run(experiment, run_name=setup.run_name).info.run_id
            known = {}
        else:
            client.update_run(self.run_id, status="RUNNING")
        # MLflow parameters cannot change: a resumed run adds the keys its run lacks.
        params = [Param(k, v) for k, v in _flat_params(setup.config).items() if k not in known]
        for i in range(0, len(params), _MLFLOW_PARAMS):
            client.log_batch(self.run_id, params=params[i:i + _MLFLOW_PARAMS])
        say(f"MLflow: run {self.run_id} of experiment {setup.project} in {uri}")

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._Metric(mlflow_key(k, self.file_store), float(v), now, step)
                   for k, v in values.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_BATCH])

    def close(self, outcome: str) -> None:
        self._client.set_terminated(self.run_id, status=_MLFLOW_STATUS.get(outcome, "FINISHED"))


def mlflow_key(key: str, file_store: bool) -> str:
    """The MLflow metric key of a metrics.jsonl key (see ``MlflowTracker``): MLflow allows
    alphanumerics, ``_ - . : /`` and spaces, so ``@`` is written ``_at_`` (``eval/pass@1`` ->
    ``eval/pass_at_1``)."""
    key = key.replace("@", "_at_")
    return key.replace("/", ".") if file_store else key


def _flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The recipe as MLflow parameters: ``table.key`` -> the value as text (lists and free-form
    tables, whose keys are the user's, as JSON), cut to MLflow's length limit."""
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
    except ImportError:  # pragma: no cover - named so in every MLflow 2 and 3
        limit = 6000
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and name not in FREEFORM_KEYS:
            out.update(_flat_params(value, name + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        out[name] = text[:limit]
    return out


STARTERS: dict[str, Callable[[TrackerSetup, str | None, Callable[[str], None]], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


# --- the fan-out --------------------------------------------------------------------------------

class Trackers:
    """The trackers of one run (rank 0), started from ``names``.

    ``resume``: the tracker run ids of the checkpoint the run resumes from (None: a fresh run);
    ``rows``: the metrics rows the run continues (the checkpoint's); ``say``: one line to the
    user (warnings included).
    """

    def __init__(self, names: tuple[str, ...], setup: TrackerSetup, *,
                 resume: Mapping[str, str] | None, rows: list[dict[str, Any]],
                 say: Callable[[str], None]) -> None:
        self.say = say
        self.path = setup.output_dir / PROGRESS_FILE
        self.live: list[Tracker] = []
        self.ids: dict[str, str] = {}  # what the next checkpoint keeps: one id per tracker named
        self.through: dict[str, int] = {}  # the last step each tracker has
        self._progress_failed = False
        recorded = _read_progress(self.path) if resume is not None else {}
        last_row = max((int(r["step"]) for r in rows if isinstance(r.get("step"), int)),
                       default=-1)
        for name in names:
            resume_id = resume.get(name) if resume is not None else None
            if resume_id is not None:
                self.ids[name] = resume_id
            try:
                tracker = STARTERS[name](setup, resume_id, say)
            except Exception as exc:  # any library error: the run goes on without it
                self._warn(name, "did not start", exc)
                continue
            self.ids[name] = tracker.run_id
            self.live.append(tracker)
            if tracker.resumed:
                seen = recorded.get(name, {})
                step = seen.get("step") if seen.get("id") == tracker.run_id else None
                self.through[name] = max(last_row, step if isinstance(step, int) else -1)
            else:
                self.through[name] = -1
                for row in rows:  # a new tracker run gets the rows the run continues
                    if not self._log_to(tracker, row):
                        break
        if self.live:
            self._save_progress()

    def _warn(self, name: str, what: str, exc: BaseException,
              tail: str = "; the run goes on without it and metrics.jsonl has every row") -> None:
        reason = safe_line(f"{type(exc).__name__}: {exc}", _MAX_REASON)
        self.say(f"warning: {LABELS[name]} {what} ({reason}){tail}")

    def _log_to(self, tracker: Tracker, row: Mapping[str, Any]) -> bool:
        """Log ``row`` to ``tracker`` unless it has the step; False when the tracker failed
        (it is dropped, saying so once)."""
        step = row.get("step")
        if not isinstance(step, int) or step <= self.through[tracker.name]:
            return True
        try:
            tracker.log(numbers(row), step)
        except Exception as exc:
            self.live.remove(tracker)
            self._warn(tracker.name, f"stopped logging at step {step}", exc)
            return False
        self.through[tracker.name] = step
        return True

    def log(self, row: Mapping[str, Any]) -> None:
        for tracker in list(self.live):
            self._log_to(tracker, row)
        self._save_progress()

    def _save_progress(self) -> None:
        if self._progress_failed:
            return
        record = {name: {"id": self.ids.get(name, ""), "step": step}
                  for name, step in self.through.items()}
        tmp = self.path.with_name(f".{PROGRESS_FILE}.tmp")
        try:
            tmp.unlink(missing_ok=True)
            with open(tmp, "w", encoding="utf-8", opener=no_follow) as handle:
                handle.write(json.dumps(record, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            self._progress_failed = True
            self.say(safe_line(f"warning: cannot record the trackers' progress in {self.path} "
                               f"({exc.strerror or exc}); a resume may log some steps twice"))

    def close(self, outcome: str = "finished") -> None:
        for tracker in self.live:
            try:
                tracker.close(outcome)
            except Exception as exc:
                self._warn(tracker.name, "did not close cleanly", exc, tail="")
        self.live = []


def _read_progress(path: Path) -> dict[str, dict[str, Any]]:
    """trackers.json as written by ``Trackers`` ({} when absent or unreadable)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(v, dict)}
