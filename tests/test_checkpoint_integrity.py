"""Checkpoints that survive damaged storage: manifests, verified resume with fallback, and
writes that fail cleanly (full disk, read-only folder)."""

from __future__ import annotations

import errno
import json
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from runner.errors import RuntimeFailure
from runner.state import checkpoint as ckpt_mod
from runner.state.checkpoint import WholeState, save_checkpoint
from runner.state.integrity import MANIFEST, file_sha256, verify
from runner.state.layout import COMPLETE, LATEST, TrainingState
from runner.state.load import latest_checkpoint, load_checkpoint


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg)


def _save(root: Path, step: int, model, keep_last: int = 5) -> Path:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainingState(step=step, cursor=None, scheduler={"last_epoch": step})
    return save_checkpoint(root, step, policy=WholeState(model, opt), tokenizer=None,
                           state=state, metrics_rows=[{"step": s} for s in range(1, step + 1)],
                           keep_last=keep_last)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, model) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "checkpoints"
    _save(root, 1, model)
    _save(root, 2, model)
    return root


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_manifest_records_every_file(pristine):
    folder = pristine / "step-000002"
    doc = json.loads((folder / MANIFEST).read_text())
    listed = sorted(doc["files"])
    assert listed == [f for f in _files(folder) if f not in (MANIFEST, COMPLETE)]
    assert "model/model.safetensors" in listed and "optimizer.safetensors" in listed
    for rel, entry in doc["files"].items():
        assert entry == {"size": (folder / rel).stat().st_size,
                         "sha256": file_sha256(folder / rel)}
    assert doc["step"] == 2 and verify(folder) == ""


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


FAULTS = {"corrupt": _corrupt, "truncate": _truncate, "delete": Path.unlink}


def _expected_reason(rel: str, fault: str, size: int) -> str | None:
    """Why step 2 must be skipped after ``fault`` on ``rel`` (None: it is still intact)."""
    if rel == COMPLETE:
        return ("no COMPLETE marker (an interrupted write or deletion)" if fault == "delete"
                else None)
    if rel == MANIFEST:
        return "MANIFEST.json is missing (written by an older version, or deleted)" \
            if fault == "delete" else "MANIFEST.json is damaged"
    if fault == "delete":
        return f"{rel} is missing"
    if fault == "truncate":
        return f"{rel} has {size // 2} bytes where the manifest records {size}"
    return f"{rel} does not match its recorded sha256"


def test_every_fault_of_the_newest_checkpoint_falls_back(pristine, tmp_path):
    names = _files(pristine / "step-000002")
    assert len(names) >= 9
    cases = 0
    for rel in names:
        for fault, apply in FAULTS.items():
            root = tmp_path / f"case-{cases}"
            shutil.copytree(pristine, root)
            target = root / "step-000002" / rel
            size = target.stat().st_size
            assert size >= 1
            apply(target)
            messages: list[str] = []
            found = latest_checkpoint(root, on_skip=messages.append)
            reason = _expected_reason(rel, fault, size)
            if reason is None:
                assert found == root / "step-000002" and messages == [], (rel, fault)
            else:
                assert found == root / "step-000001", (rel, fault)
                assert messages == [f"skipping checkpoint {root / 'step-000002'}: {reason}"]
                assert load_checkpoint(found).state.step == 1
            cases += 1
    assert cases == 3 * len(names)


def test_default_skip_report_is_a_warning(pristine, tmp_path, caplog):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    (root / "step-000002" / "state.json").unlink()
    with caplog.at_level("WARNING", logger="runner.state.load"):
        assert latest_checkpoint(root) == root / "step-000001"
    assert caplog.messages == [f"skipping checkpoint {root / 'step-000002'}: state.json is missing"]


def test_no_intact_checkpoint_is_a_clear_error(pristine, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    _truncate(root / "step-000002" / "model" / "model.safetensors")
    (root / "step-000001" / MANIFEST).unlink()
    with pytest.raises(RuntimeFailure) as info:
        latest_checkpoint(root, on_skip=lambda _: None)
    assert str(info.value).startswith(f"resume: no intact checkpoint in {root} (step-000002: "
                                      "model/model.safetensors has ")
    assert str(info.value).endswith(
        "; step-000001: MANIFEST.json is missing (written by an older version, or deleted)); "
        "set checkpoint.resume = 'never' or choose another run.output_dir to start over")


def test_no_checkpoint_at_all_is_a_fresh_start(tmp_path):
    assert latest_checkpoint(tmp_path / "none") is None
    (tmp_path / "c" / "step-000004").mkdir(parents=True)  # an interrupted deletion, no marker
    assert latest_checkpoint(tmp_path / "c", on_skip=lambda _: None) is None


@pytest.mark.parametrize("pointer", [b"\xff\xfe\x00step", b"../../elsewhere", b"step-000009",
                                     b"step-000001\n"])
def test_latest_pointer_with_any_bytes(pristine, tmp_path, pointer):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    (root / LATEST).write_bytes(pointer)
    expected = "step-000001" if pointer.strip() == b"step-000001" else "step-000002"
    assert latest_checkpoint(root, on_skip=lambda _: None) == root / expected


def test_folders_that_only_look_like_checkpoints_are_ignored(pristine, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    (root / "step-old").mkdir()
    (root / "step-old" / COMPLETE).write_text("x")
    assert latest_checkpoint(root) == root / "step-000002"


def test_a_damaged_file_is_one_error_at_load(pristine, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    (root / "step-000002" / "rng.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(RuntimeFailure) as info:
        load_checkpoint(root / "step-000002")
    assert str(info.value).startswith(f"resume: cannot load checkpoint {root / 'step-000002'}: "
                                      "rng.safetensors: SafetensorError: ")


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in root.rglob("*") if p.is_file()}


def test_a_full_disk_fails_cleanly(pristine, tmp_path, model):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    before = _tree(root)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))  # no file may grow past 2 KiB
    try:
        with pytest.raises(RuntimeFailure) as info:
            _save(root, 3, model)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    message = str(info.value)
    assert message.startswith(f"policy at step 3: cannot write checkpoint {root / 'step-000003'} (")
    assert "File too large" in message and "\n" not in message
    assert message.endswith("; the partial checkpoint was removed and earlier checkpoints are "
                            "untouched")
    assert _tree(root) == before  # nothing left behind, nothing earlier touched
    assert latest_checkpoint(root) == root / "step-000002"


def test_a_read_only_folder_fails_cleanly(pristine, tmp_path, model, monkeypatch):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    before = _tree(root)
    real_write = ckpt_mod._write_json

    def read_only(path: Path, value) -> None:
        real_write(path, value)  # the first file lands, then the filesystem turns read-only
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(ckpt_mod, "_write_json", read_only)
    with pytest.raises(RuntimeFailure) as info:
        _save(root, 3, model)
    assert str(info.value) == (
        f"policy at step 3: cannot write checkpoint {root / 'step-000003'} (optimizer.json): "
        "Read-only file system [errno 30]; the partial checkpoint was removed and earlier "
        "checkpoints are untouched")
    assert _tree(root) == before


def test_metrics_write_errors_are_one_line(tmp_path, monkeypatch):
    from runner.ui.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl", rows=[{"step": 1, "loss": 0.5}])
    real_open = open

    def read_only(path, mode="r", *args, **kwargs):
        if "a" in mode or "w" in mode:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", read_only)
    with pytest.raises(RuntimeFailure) as info:
        log.write({"step": 2, "loss": 0.25})
    assert str(info.value) == ("policy at step 2: cannot write metrics to "
                               f"{tmp_path / 'metrics.jsonl'}: Read-only file system [errno 30]")
    with pytest.raises(RuntimeFailure) as info:
        MetricsLog(tmp_path / "metrics.jsonl", rows=[{"step": 7}])
    assert str(info.value).startswith("policy at step 7: cannot write metrics to ")
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"loss": 0.5, "step": 1}\n'
    assert log.rows == [{"step": 1, "loss": 0.5}]


def test_a_checkpoint_from_before_manifests_is_resumed_unverified(pristine, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    folder = root / "step-000002"
    (folder / MANIFEST).unlink()
    state = json.loads((folder / "state.json").read_text())
    for key in ("world_size", "items_per_step"):  # what versions without manifests wrote
        del state[key]
    (folder / "state.json").write_text(json.dumps(state))
    skipped = []
    assert latest_checkpoint(root, on_skip=skipped.append) == folder
    assert skipped == []
