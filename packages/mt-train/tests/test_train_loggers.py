"""Metric loggers: one interface for JSONL, TensorBoard, W&B, MLflow and plugins; the run record.

W&B and MLflow are each checked twice: against a stand-in module that records our calls
(always runs), and for real, offline, in the run folder when the library is installed (skipped
otherwise).
"""

from __future__ import annotations

import errno
import json
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
from train_checks import fit, tiny_overrides

from mt_core import hookimpl, register_plugin, reset_plugin_manager
from mt_train.cli import validate_overrides
from mt_train.loggers import RUN_RECORD, git_commit


class FakeWandbRun:
    def __init__(self, **kwargs: Any) -> None:
        self.init = kwargs
        self.logged: list[dict] = []
        self.defined: list[tuple] = []
        self.finished = False

    def define_metric(self, name: str, **kwargs: Any) -> None:
        self.defined.append((name, kwargs))

    def log(self, values: dict) -> None:
        self.logged.append(values)

    def finish(self) -> None:
        self.finished = True


def test_wandb_logger_calls(
    kjv_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[FakeWandbRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: runs.append(FakeWandbRun(**kwargs)) or runs[-1]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    trainer, _ = fit(tiny_overrides(kjv_data, logging="wandb"), tmp_path)
    (run,) = runs
    assert run.init["mode"] == "offline" and run.init["project"] == "mt-train"
    assert run.init["dir"] == str(tmp_path) and run.init["id"] == trainer.run_id
    assert run.init["config"]["model"]["dim"] == 64
    assert run.init["config"]["git_commit"] == git_commit()
    assert ("*", {"step_metric": "step"}) in run.defined
    train = [r for r in run.logged if "train/loss" in r]
    assert [r["step"] for r in train] == [4, 8]
    assert "train/time/forward_backward" in train[0]
    assert any("eval/val_loss" in r for r in run.logged)
    assert run.finished


def test_wandb_offline_run_writes_its_files(kjv_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    fit(tiny_overrides(kjv_data, logging="wandb"), tmp_path)
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(offline.glob("run-*.wandb"))


def test_mlflow_logger_calls(
    kjv_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, tuple, dict]] = []
    fake = types.ModuleType("mlflow")
    for name in (
        "set_tracking_uri", "get_experiment_by_name", "create_experiment", "set_experiment",
        "start_run", "set_tags", "log_dict", "log_metrics", "end_run",
    ):  # fmt: skip
        setattr(fake, name, lambda *a, _n=name, **k: calls.append((_n, a, k)))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    trainer, _ = fit(tiny_overrides(kjv_data, **{"logging.mlflow": "true"}), tmp_path)
    by_name: dict[str, list] = {}
    for name, args, kwargs in calls:
        by_name.setdefault(name, []).append((args, kwargs))
    assert by_name["set_tracking_uri"] == [((f"sqlite:///{tmp_path / 'mlflow.db'}",), {})]
    artifacts = (tmp_path / "mlartifacts").as_uri()
    assert by_name["create_experiment"] == [(("mt-train",), {"artifact_location": artifacts})]
    assert by_name["set_experiment"] == [(("mt-train",), {})]
    ((tags,), _) = by_name["set_tags"][0]
    assert tags == {"mt.run_id": trainer.run_id, "mt.git_commit": str(git_commit())}
    ((config, artifact), _) = by_name["log_dict"][0]
    assert artifact == "config.json" and config["model"]["dim"] == 64
    train = [(a[0], k["step"]) for a, k in by_name["log_metrics"] if "train/loss" in a[0]]
    assert [step for _, step in train] == [4, 8] and "train/time/step" in train[0][0]
    assert [name for name, _, _ in calls][-1] == "end_run"


def test_mlflow_run_in_the_run_folder(kjv_data: Path, tmp_path: Path) -> None:
    mlflow = pytest.importorskip("mlflow")
    trainer, _ = fit(tiny_overrides(kjv_data, **{"logging.mlflow": "true"}), tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("mt-train")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["mt.run_id"] == trainer.run_id
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [4, 8]
    config = tmp_path / "mlartifacts" / run.info.run_id / "artifacts" / "config.json"
    assert json.loads(config.read_text())["trainer"]["seq_len"] == 64


class MemoryLogger:
    """A third-party logger: keeps what it is given."""

    records: ClassVar[list[tuple[int, str, dict]]] = []
    closed = False

    def __init__(self, cfg: Any, run: Any) -> None:
        MemoryLogger.run = run

    def log(self, step: int, kind: str, metrics: dict) -> None:
        MemoryLogger.records.append((step, kind, metrics))

    def close(self) -> None:
        MemoryLogger.closed = True


class MemoryLoggerPlugin:
    @hookimpl
    def mt_register_loggers(self, registry: Any) -> None:
        registry.add("memory", MemoryLogger)


def test_third_party_logger_through_the_hook(kjv_data: Path, tmp_path: Path) -> None:
    register_plugin(MemoryLoggerPlugin(), "test-memory-logger")
    MemoryLogger.records.clear()
    try:
        overrides = tiny_overrides(kjv_data, **{"logging.loggers": "[memory]"})
        assert validate_overrides(overrides) is None
        fit(overrides, tmp_path)
    finally:
        reset_plugin_manager()
    train = [(step, m) for step, kind, m in MemoryLogger.records if kind == "train"]
    assert [step for step, _ in train] == [4, 8] and "loss" in train[0][1]
    assert MemoryLogger.closed and MemoryLogger.run.output_dir == tmp_path
    # The built-in JSONL logger ran beside it and saw the same records.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if '"train"' in line] == [4, 8]


def test_unknown_logger_is_a_one_line_config_error(kjv_data: Path) -> None:
    error = validate_overrides(tiny_overrides(kjv_data, **{"logging.loggers": "[nope]"}))
    assert error is not None and "\n" not in error
    assert "['nope']" in error and "jsonl" in error and "wandb" in error


def test_run_record_holds_config_and_commit(kjv_data: Path, tmp_path: Path) -> None:
    trainer, _ = fit(tiny_overrides(kjv_data), tmp_path)
    (record,) = [json.loads(line) for line in (tmp_path / RUN_RECORD).read_text().splitlines()]
    assert record["run_id"] == trainer.run_id and record["resumed_at_step"] == 0
    assert record["config"]["trainer"]["seq_len"] == 64
    assert record["git_commit"] == git_commit()
    assert record["git_commit"] is None or len(record["git_commit"].split("-")[0]) == 40


def test_a_logger_failing_on_a_full_disk_is_dropped_with_one_warning(
    kjv_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from mt_train.loggers.jsonl import JsonlSink

    write = JsonlSink.log
    calls = []

    def full_after_one(self: JsonlSink, step: int, kind: str, metrics: dict) -> None:
        calls.append(step)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, step, kind, metrics)

    monkeypatch.setattr(JsonlSink, "log", full_after_one)
    register_plugin(MemoryLoggerPlugin(), "test-memory-logger")
    MemoryLogger.records.clear()
    try:
        _, summary = fit(tiny_overrides(kjv_data, **{"logging.loggers": "[memory]"}), tmp_path)
    finally:
        reset_plugin_manager()
    assert summary.steps == 8  # training went on
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert len(calls) == 2  # dropped after its first failure
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        f"mt-train: warning: cannot write {tmp_path / 'metrics.jsonl'}: No space left on device "
        "(ENOSPC); the jsonl logger stops here, training goes on"
    ]
    assert [s for s, k, _ in MemoryLogger.records if k == "train"] == [4, 8]  # the others go on


def test_a_logger_that_cannot_start_is_left_out(
    kjv_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from mt_train.loggers.jsonl import JsonlSink

    def read_only(self: JsonlSink, cfg: Any, run: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(run.output_dir / "metrics.jsonl"))

    monkeypatch.setattr(JsonlSink, "__init__", read_only)
    _, summary = fit(tiny_overrides(kjv_data), tmp_path)
    assert summary.steps == 8 and not (tmp_path / "metrics.jsonl").exists()
    assert (
        f"mt-train: warning: cannot write {tmp_path / 'metrics.jsonl'}: Read-only file system "
        "(EROFS); the jsonl logger stops here, training goes on"
    ) in capsys.readouterr().err
