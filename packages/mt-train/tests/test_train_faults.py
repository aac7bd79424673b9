"""Faults a run must survive or report in one line (the matrix is ``docs/reliability.md``):
kills between the phases of a checkpoint save, full and read-only disks at every write site,
damaged manifests, a torn events log and a garbage rewind decisions file on resume, every
checkpoint bad, a NaN with rewind off, and two writers on one run folder."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_checks import assert_one_error_line, run_cli, run_forked, run_overrides, small_data
from train_checks import fit, tiny_overrides

from mt_train.checkpoint import CheckpointReader, list_checkpoints, verify_checkpoint
from mt_train.checkpoint.files import step_folders
from mt_train.rewind import read_events
from mt_train.run_lock import LOCK_FILE, process_start


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_data(tmp_path_factory.mktemp("small") / "data")


@pytest.fixture(scope="module")
def trained(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run with checkpoints at steps 4 and 8 (copied before any damage)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    fit(tiny_overrides(data), out)
    return out


def _copy(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def _leftovers(root: Path) -> list[str]:
    """Folders of the checkpoint root that are neither complete checkpoints nor rejected."""
    complete = {p.name for p in list_checkpoints(root)}
    return sorted(
        p.name for p in root.iterdir() if p.is_dir() and p.name not in complete
        and not p.name.startswith("rejected-")
    )  # fmt: skip


# ---------------------------------------------------------------- kills inside a save
@pytest.mark.parametrize(
    ("phase", "newest"),
    [
        pytest.param("shard", 4, marks=pytest.mark.slow),
        ("manifest", 4),
        pytest.param("publish", 8, marks=pytest.mark.slow),
        ("prune", 8),
    ],
)
def test_kill_between_save_phases_resumes_from_the_newest_complete(
    phase: str, newest: int, data: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    args = run_overrides(
        data, out,
        **{"trainer.max_steps": 12, "checkpoint.keep_last": 1, "fault.kill_in_save": phase,
           "fault.save_step": 8},
    )  # fmt: skip
    killed = run_forked(args)
    assert killed.returncode == -9, killed.stderr[-3000:]
    root = out / "checkpoints"
    # Every step-* folder is complete: the kill left at most a .tmp-* or .del-* folder.
    assert all((p / "manifest.json").is_file() for p in step_folders(root))
    assert list_checkpoints(root)[-1].name == f"step-{newest:08d}"
    assert verify_checkpoint(list_checkpoints(root)[-1]) is None

    # The kill is disarmed now; only the killed run needs a process of its own.
    status, err = run_cli(capsys, [*args, "checkpoint.resume=auto"])
    assert status == 0, err[-3000:]
    (resume,) = [e for e in read_events(out) if e["event"] == "resume"]
    assert resume["step"] == newest
    assert [p.name for p in list_checkpoints(root)] == ["step-00000012"]
    assert _leftovers(root) == []


# ---------------------------------------------------------------- full and read-only disks
@pytest.mark.parametrize(
    ("site", "errno_name", "extra", "expected"),
    [
        ("run_dir", "EROFS", {}, "cannot write the run folder"),
        ("data", "ENOSPC", {"data.path": None}, "cannot write the prepared data folder"),
        ("checkpoint", "ENOSPC", {}, "cannot write checkpoint step 8"),
        ("checkpoint", "ENOSPC", {"checkpoint.async_save": True}, "cannot write checkpoint step 8"),
        ("manifest", "EACCES", {}, "manifest.json': Permission denied (EACCES)"),
        ("publish", "EROFS", {}, "step-00000008': Read-only file system (EROFS)"),
        ("events", "ENOSPC", {"checkpoint.resume": "auto"}, "cannot write the events log"),
    ],
)
def test_disk_error_stops_with_one_line_and_keeps_the_newest_checkpoint(
    site: str, errno_name: str, extra: dict, expected: str, data: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    faults = {"fault.disk_error": site, "fault.disk_errno": errno_name, "fault.save_step": 8}
    args = run_overrides(data, out, **{"trainer.max_steps": 12, **faults, **extra})
    status, err = run_cli(capsys, args)
    assert_one_error_line(status, err, expected)
    assert errno_name in err.strip().splitlines()[-1]
    root = out / "checkpoints"
    if site in ("checkpoint", "manifest", "publish"):
        assert [p.name for p in list_checkpoints(root)] == ["step-00000004"]
        assert verify_checkpoint(root / "step-00000004") is None
        assert _leftovers(root) == []  # the half-written .tmp-step-00000008 is gone
        # The disk is fine again: the same command resumes from step 4 and finishes.
        healthy = run_overrides(data, out, **{"trainer.max_steps": 12, **extra})
        status, err = run_cli(capsys, [*healthy, "checkpoint.resume=auto"])
        assert status == 0, err[-3000:]
        assert "resume: from" in err and "step-00000004 (step 4)" in err
        assert CheckpointReader(root / "step-00000012").manifest["step"] == 12


def test_failed_background_save_stops_the_run_at_the_next_step(
    data: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    extra = {"checkpoint.async_save": True, "fault.disk_error": "checkpoint", "fault.save_step": 4}
    status, err = run_cli(capsys, run_overrides(data, out, **extra))
    assert_one_error_line(status, err, "cannot write checkpoint step 4")
    assert "step 8 train" not in err  # stopped within the steps after the save, not at step 8
    assert list_checkpoints(out / "checkpoints") == []
    assert _leftovers(out / "checkpoints") == []


def test_metrics_disk_error_warns_and_training_goes_on(data: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    status, err = run_cli(capsys, run_overrides(data, out, **{"fault.disk_error": "metrics"}))
    assert status == 0, err[-3000:]
    warnings = [line for line in err.splitlines() if line.startswith("mt-train: warning: ")]
    assert len(warnings) == 1 and "metrics.jsonl" in warnings[0] and "ENOSPC" in warnings[0]
    assert (out / "checkpoints" / "step-00000008" / "manifest.json").is_file()


def test_decisions_disk_error_after_a_rewind(data: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    extra = {"rewind": "default", "fault.nan_at_step": 6, "fault.disk_error": "decisions"}
    status, err = run_cli(capsys, run_overrides(data, out, **extra))
    assert_one_error_line(status, err, "cannot write the rewind decisions file")


# ---------------------------------------------------------------- damaged files on resume
MANIFESTS = {
    "a list": ([1, 2], "holds a JSON list, not an object"),
    "no shards": ("drop:shards", "manifest lacks ['shards']"),
    "shards null": ("set:shards", "manifest shards is None, not a non-empty object"),
    "no tensors": ("empty:tensors", "manifest tensors is {}, not a non-empty object"),
    "deleted": (None, "no manifest.json"),
}


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_damaged_manifest_falls_back_to_the_previous_checkpoint(
    case: str, data: Path, trained: Path, tmp_path: Path, capsys
) -> None:
    out = _copy(trained, tmp_path)
    path = out / "checkpoints" / "step-00000008" / "manifest.json"
    damage, reason = MANIFESTS[case]
    if damage is None:
        path.unlink()
    elif isinstance(damage, list):
        path.write_text(json.dumps(damage))
    else:
        action, key = damage.split(":")
        manifest = json.loads(path.read_text())
        if action == "drop":
            del manifest[key]
        else:
            manifest[key] = None if action == "set" else {}
        path.write_text(json.dumps(manifest))
    args = run_overrides(data, out, **{"checkpoint.resume": "auto", "trainer.max_steps": 10})
    status, err = run_cli(capsys, args)
    assert status == 0, err[-3000:]
    assert f"checkpoint rejected: {path.parent}: " in err and reason in err
    assert f"resume: from {out / 'checkpoints' / 'step-00000004'} (step 4)" in err
    (rejected,) = [e for e in read_events(out) if e["event"] == "checkpoint_rejected"]
    assert reason in rejected["reason"]


def test_every_checkpoint_bad_starts_fresh_saying_so_and_must_refuses(
    data: Path, trained: Path, tmp_path: Path, capsys
) -> None:
    out = _copy(trained, tmp_path)
    for folder in list_checkpoints(out / "checkpoints"):
        (folder / "manifest.json").write_text("[]")
    args = run_overrides(data, out, **{"checkpoint.resume": "must"})
    status, err = run_cli(capsys, args)
    assert_one_error_line(status, err, "checkpoint.resume=must: every checkpoint in")
    assert "refuses to start fresh" in err
    status, err = run_cli(capsys, [*args[:-1], "checkpoint.resume=auto"])
    assert status == 0, err[-3000:]
    assert "resume: checkpoint.resume=auto: no checkpoint in" in err  # rejected by the first
    assert "starting from step 0" in err
    (fresh,) = [e for e in read_events(out) if e["event"] == "fresh_start"]
    assert "starting from step 0" in fresh["reason"]


def test_torn_events_line_and_garbage_decisions_do_not_block_a_resume(
    data: Path, trained: Path, tmp_path: Path, capsys
) -> None:
    out = _copy(trained, tmp_path)
    events = out / "events.jsonl"
    complete = events.read_bytes() if events.is_file() else b""
    torn = b'{"event": "fault", "step": 9, "fau'  # what a crash mid-write leaves
    events.write_bytes(complete + torn)
    (out / "checkpoints" / "rewind-decisions.json").write_text('{"skipped": "all of it"}')
    args = run_overrides(data, out, **{"checkpoint.resume": "auto", "trainer.max_steps": 10})
    status, err = run_cli(capsys, args)
    assert status == 0, err[-3000:]
    assert f"events: cut a torn last line ({len(torn)} bytes" in err
    assert "rewind decisions rejected: " in err and "skipped is 'all of it'" in err
    assert (out / "checkpoints" / "rejected-rewind-decisions.json").is_file()
    assert events.read_bytes().startswith(complete)  # whole lines kept, the torn one cut
    kinds = [e["event"] for e in read_events(out)]
    assert "events_repaired" in kinds and "decisions_rejected" in kinds and "resume" in kinds


# ---------------------------------------------------------------- rewind off, two writers
def test_nan_with_rewind_off_is_rewinds_report_with_status_3(
    data: Path, tmp_path: Path, capsys
) -> None:
    status, err = run_cli(capsys, run_overrides(data, tmp_path / "run", **{"fault.nan_at_step": 3}))
    assert status == 3, err[-3000:]
    assert "Traceback" not in err
    assert "mt-train: stopped: rewind: stopped at step 3: non_finite" in err
    assert "rewind=default would have restored" in err


def _lock_of(pid: int) -> str:
    return json.dumps(
        {"pid": pid, "host": socket.gethostname(), "start": process_start(pid), "command": "x"}
    )


def test_second_writer_is_refused_and_a_dead_holder_taken_over(
    data: Path, trained: Path, tmp_path: Path, capsys
) -> None:
    out = _copy(trained, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / LOCK_FILE).write_text(_lock_of(holder.pid))
        args = run_overrides(data, out, **{"checkpoint.resume": "auto", "trainer.max_steps": 10})
        status, err = run_cli(capsys, args)
        assert_one_error_line(status, err, f"is in use by a running mt-train (pid {holder.pid}")
        assert [p.name for p in list_checkpoints(out / "checkpoints")][-1] == "step-00000008"
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone (as after a SIGKILL): the next run takes the lock over and trains.
    status, err = run_cli(capsys, args)
    assert status == 0, err[-3000:]
    assert f"took over {out / LOCK_FILE} from pid {holder.pid}, which is gone" in err
    assert not (out / LOCK_FILE).exists()  # released at the end
    assert os.getpid() != holder.pid


def test_safetensors_io_error_is_raised_as_the_oserror_it_names(
    tmp_path: Path, monkeypatch
) -> None:
    # safetensors formats a failed write as "Error while serializing: {io::Error:?}"; the
    # shard writer hands the caller the OSError inside (ENOSPC here), path included.
    import torch
    from safetensors import SafetensorError

    from mt_train.checkpoint import files

    def full_disk(*_args: object, **_kwargs: object) -> None:
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
            'space left on device" })'
        )

    monkeypatch.setattr(files, "save_file", full_disk)
    with pytest.raises(OSError) as err:
        files.write_shard(tmp_path / ".tmp-step-00000001", 0, "run", {"w": torch.zeros(2)}, 1)
    assert err.value.errno == 28 and err.value.filename.endswith("rank-00000.safetensors")
