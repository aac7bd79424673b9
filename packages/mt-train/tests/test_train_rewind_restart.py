"""Crashes and restarts: SIGKILL then ``resume=auto`` equals an uninterrupted run bit for bit,
SIGTERM saves and exits cleanly, and corrupt or partial checkpoints are detected, logged and
passed over — on resume and on a rewind from disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_checks import run_forked
from safetensors.torch import load_file
from train_checks import rewind_overrides, run_losses, run_rewind

from mt_train import Trainer, compose_config, to_train_config
from mt_train.checkpoint import list_checkpoints
from mt_train.cli import main
from mt_train.rewind import read_events


def _main(capsys: pytest.CaptureFixture, overrides: list[str], out: Path) -> tuple[int, str, str]:
    """``mt-train`` in this process, writing to ``out``: its exit status, stdout and stderr."""
    capsys.readouterr()
    status = main([*overrides, f"trainer.output_dir={out}", f"hydra.run.dir={out}"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _train_losses(out: Path) -> dict[int, float]:
    """The last logged training loss of every logged step (a restart appends to the file)."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_kill_and_restart_equals_an_uninterrupted_run(
    kjv_data: Path, tmp_path: Path, capsys
) -> None:
    common = {
        "trainer.max_steps": 24,
        "trainer.eval_interval": 24,
        "trainer.log_interval": 1,
        "checkpoint.async_save": True,  # the kill may land while step-12 is being written
        "scheduler": "constant",
    }
    # Only the killed run needs a process of its own; the others run the same entry point here.
    status, _, err = _main(capsys, rewind_overrides(kjv_data, **common), tmp_path / "full")
    assert status == 0, err[-3000:]

    out = tmp_path / "killed"
    overrides = rewind_overrides(kjv_data, **common, **{"fault.kill_at_step": 13})
    killed = run_forked([*overrides, f"trainer.output_dir={out}", f"hydra.run.dir={out}"])
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [e["fault"] for e in read_events(out) if e["event"] == "fault"] == ["kill"]
    # The same command with resume=auto: the kill fault is disarmed (it already fired here).
    status, _, err = _main(capsys, [*overrides, "checkpoint.resume=auto"], out)
    assert status == 0, err[-3000:]
    resumes = [e for e in read_events(out) if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] in (8, 12)

    assert _train_losses(out) == _train_losses(tmp_path / "full")  # exact, every step
    final = "checkpoints/step-00000024/rank-00000.safetensors"
    a, b = load_file(tmp_path / "full" / final), load_file(out / final)
    assert a.keys() == b.keys()
    for name in a:  # model, AdamW state and RNG, bit for bit
        assert torch.equal(a[name], b[name]), name


def test_sigterm_saves_and_exits_then_resumes_exactly(kjv_data: Path, tmp_path: Path) -> None:
    common = {"trainer.max_steps": 20, "trainer.eval_interval": 20, "scheduler": "constant"}
    full = run_losses(rewind_overrides(kjv_data, **common), tmp_path / "full")

    out = tmp_path / "preempted"
    overrides = rewind_overrides(kjv_data, **common, **{"fault.sigterm_at_step": 10})
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=out)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    # The signal arrived as step 10 began: step 10 was finished, saved, and the run returned.
    assert summary.stopped == "SIGTERM" and summary.steps == 10
    assert summary.losses == full[:10]
    assert (out / "checkpoints" / "step-00000010" / "manifest.json").is_file()
    (preempted,) = [e for e in read_events(out) if e["event"] == "preempted"]
    assert preempted["signal"] == "SIGTERM" and preempted["step"] == 10
    assert preempted["checkpoint"] == str(out / "checkpoints" / "step-00000010")

    resumed = run_losses([*overrides, "checkpoint.resume=auto"], out)
    assert resumed == full[10:]


@pytest.mark.parametrize("damage", ["corrupt", "partial"])
def test_resume_passes_over_a_damaged_checkpoint(
    damage: str, kjv_data: Path, tmp_path: Path
) -> None:
    run_losses(rewind_overrides(kjv_data, **{"trainer.max_steps": 12}), tmp_path)
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000008", "step-00000012"]
    extra = {"trainer.max_steps": 16, "checkpoint.resume": "auto"}
    if damage == "corrupt":
        extra["fault.corrupt_latest_checkpoint"] = True
    else:  # a shard gone missing after the manifest was written
        (root / "step-00000012" / "rank-00000.safetensors").unlink()
    trainer = Trainer(
        to_train_config(compose_config(rewind_overrides(kjv_data, **extra))),
        output_dir=tmp_path,
    )
    try:
        assert trainer.step == 8
        trainer.fit()
    finally:
        trainer.close()
    events = read_events(tmp_path)
    (rejected,) = [e for e in events if e["event"] == "checkpoint_rejected"]
    assert rejected["path"] == str(root / "step-00000012")
    expected = "sha256" if damage == "corrupt" else "shard rank-00000.safetensors is missing"
    assert expected in rejected["reason"]
    assert rejected["moved_to"] == str(root / "rejected-step-00000012")
    assert (root / "rejected-step-00000012").is_dir()
    (resume,) = [e for e in events if e["event"] == "resume"]
    assert resume["path"] == str(root / "step-00000008") and resume["step"] == 8
    assert [p.name for p in list_checkpoints(root)][-1] == "step-00000016"


def test_rewind_from_disk_passes_over_a_corrupt_stable_checkpoint(
    kjv_data: Path, tmp_path: Path
) -> None:
    overrides = rewind_overrides(
        kjv_data, **{"fault.nan_at_step": 30, "rewind.memory_snapshots": False}
    )
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)
    real_step, done = trainer.train_step, []

    def corrupt_then_step():  # damage step-24 (the stable one) just before the anomaly
        if trainer.step == 29 and not done:
            done.append(True)
            shard = tmp_path / "checkpoints" / "step-00000024" / "rank-00000.safetensors"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        return real_step()

    trainer.train_step = corrupt_then_step  # type: ignore[method-assign]
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary.steps == 60 and summary.rewinds == 1
    events = read_events(tmp_path)
    (rejected,) = [e for e in events if e["event"] == "checkpoint_rejected"]
    assert rejected["step"] == 24 and "sha256" in rejected["reason"]
    (rewind,) = [e for e in events if e["event"] == "rewind"]
    # Nothing stable is left: the oldest other target, step-28, from disk, marked unstable.
    assert rewind["restored"]["step"] == 28 and rewind["restored"]["source"] == "disk"
    assert rewind["restored"]["stable"] is False


def test_preempted_cli_run_exits_zero(kjv_data: Path, tmp_path: Path, capsys) -> None:
    overrides = rewind_overrides(kjv_data, **{"trainer.max_steps": 8, "fault.sigterm_at_step": 6})
    status, out, err = _main(capsys, overrides, tmp_path)
    assert status == 0, err[-3000:]
    assert "preempted by SIGTERM at step 6" in err, err[-3000:]
    assert "stopped early by SIGTERM after step 6" in out
    assert (tmp_path / "checkpoints" / "step-00000006" / "manifest.json").is_file()


def test_crash_right_after_a_rewind_loses_no_decision(kjv_data: Path, tmp_path: Path) -> None:
    # The reference: a NaN at step 30 rewinds to step 24 and skips draws [192, 240).
    nan = {"fault.nan_at_step": 30, "trainer.max_steps": 40, "trainer.eval_interval": 40}
    reference = run_rewind(rewind_overrides(kjv_data, **nan), tmp_path / "reference")

    # The same run dies as step 27 begins after the rewind: step-28 was discarded and not yet
    # written again, so the newest checkpoint is step-24, saved before the rewind decided
    # anything. (An exception out of fit() leaves the disk as a SIGKILL would: saves are sync.)
    out = tmp_path / "crashed"
    overrides = rewind_overrides(kjv_data, **nan)
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=out)
    real_step = trainer.train_step

    def crash_after_rewind():
        if trainer.step == 26 and trainer.guard.rewinds == 1:
            raise RuntimeError("simulated crash")
        return real_step()

    trainer.train_step = crash_after_rewind  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.fit()
    trainer.close()
    assert [p.name for p in list_checkpoints(out / "checkpoints")][-1] == "step-00000024"

    resumed = run_rewind([*overrides, "checkpoint.resume=auto"], out)
    # The skipped data, the history and the LR cool-down came back from rewind-decisions.json:
    # the resumed run trains exactly as the run that never crashed.
    assert resumed["losses"] == reference["losses"][-16:]
    assert resumed["rewinds"] == 1
