"""Checkpoints: async bytes equal sync bytes, a killed save leaves the previous one loadable,
corruption is detected, the last K are kept, and a resumed run reads every piece of state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from cli_checks import Forked
from train_checks import tiny_overrides

from mt_train import Trainer, compose_config, to_train_config
from mt_train.checkpoint import CheckpointReader, list_checkpoints, read_manifest


def _trainer(data: Path, out: Path, **extra: object) -> Trainer:
    return Trainer(to_train_config(compose_config(tiny_overrides(data, **extra))), output_dir=out)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_async_save_writes_the_same_bytes_as_sync(kjv_data: Path, tmp_path: Path) -> None:
    folders = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        trainer = _trainer(
            kjv_data, out, **{"checkpoint.async_save": mode == "async", "trainer.max_steps": 4}
        )
        try:
            trainer.fit()
        finally:
            trainer.close()
        folders[mode] = out / "checkpoints" / "step-00000004"
    sync, async_ = _files(folders["sync"]), _files(folders["async"])
    assert (
        sync.keys()
        == async_.keys()
        == {"manifest.json", "rank-00000.json", "rank-00000.safetensors"}
    )
    assert sync["rank-00000.safetensors"] == async_["rank-00000.safetensors"]

    def strip(raw: bytes) -> dict:  # the configs differ in checkpoint.async_save itself
        return {k: v for k, v in json.loads(raw).items() if k != "config"}

    assert strip(sync["manifest.json"]) == strip(async_["manifest.json"])


def test_async_snapshot_is_taken_before_training_continues(kjv_data: Path, tmp_path: Path) -> None:
    trainer = _trainer(kjv_data, tmp_path, **{"checkpoint.async_save": True})
    try:
        trainer.train_step()
        expected = trainer.module.output.weight.detach().clone()
        trainer.save()
        with torch.no_grad():
            trainer.module.output.weight.add_(1.0)  # training moves on while the writer runs
        trainer.checkpointer.wait()
    finally:
        trainer.close()
    reader = CheckpointReader(tmp_path / "checkpoints" / "step-00000001")
    assert torch.equal(reader.read(["model/output.weight"])["model/output.weight"], expected)


def test_manifest_contents(kjv_data: Path, tmp_path: Path) -> None:
    trainer = _trainer(kjv_data, tmp_path, **{"trainer.max_steps": 4})
    try:
        trainer.fit()
    finally:
        trainer.close()
    manifest = read_manifest(tmp_path / "checkpoints" / "step-00000004")
    assert manifest["step"] == 4 and manifest["world_size"] == 1
    assert manifest["data"] == {"consumed": 32, "seed": 1234, "global_batch": 8}
    assert manifest["config"]["model"]["dim"] == 64
    names = set(manifest["tensors"])
    assert {"rng/rank0/cpu", "model/embed.weight", "optim/embed.weight/exp_avg"} <= names
    shard = manifest["shards"]["rank-00000.safetensors"]
    assert len(shard["sha256"]) == 64 and shard["bytes"] > 0
    assert "fp8_state" in manifest


def test_keep_last_and_corruption_detected(kjv_data: Path, tmp_path: Path) -> None:
    trainer = _trainer(
        kjv_data, tmp_path, **{"trainer.max_steps": 6, "trainer.checkpoint_interval": 2}
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    kept = list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in kept] == ["step-00000004", "step-00000006"]
    shard = kept[-1] / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is corrupt: sha256"):
        CheckpointReader(kept[-1]).read(["model/norm.weight"])


def train_and_die_before_the_step8_manifest(data: Path, out: Path) -> None:
    """Train the tiny job to step 8 and end the process once step 8's shard is written and its
    manifest is not, as a SIGKILL would (in a process of its own: it exits with status 9)."""
    import mt_train.checkpoint.checkpointer as ck
    import mt_train.checkpoint.files as files

    trainer = _trainer(data, out, **{"trainer.max_steps": 8})
    real_publish = files.publish

    def publish_then_die(root, step, *args, **kwargs):
        if step == 8:
            os._exit(9)
        return real_publish(root, step, *args, **kwargs)

    ck.publish = publish_then_die
    trainer.fit()


def test_save_killed_midway_leaves_previous_checkpoint(kjv_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = Forked(train_and_die_before_the_step8_manifest, kjv_data, out).wait()
    assert proc.returncode == 9, proc.stderr[-2000:]
    root = out / "checkpoints"
    assert (root / ".tmp-step-00000008" / "rank-00000.safetensors").is_file()
    assert [p.name for p in list_checkpoints(root)] == ["step-00000004"]

    # resume=auto ignores the half-written save, loads step 4, and the next save cleans up.
    trainer = _trainer(kjv_data, out, **{"trainer.max_steps": 8, "checkpoint.resume": "auto"})
    try:
        assert trainer.step == 4
        assert not (root / ".tmp-step-00000008").exists()
        trainer.fit()
    finally:
        trainer.close()
    assert [p.name for p in list_checkpoints(root)] == ["step-00000004", "step-00000008"]


def _save(root: Path, step: int, value: float) -> Path:
    from mt_train.checkpoint import files

    manifest = {
        "format": 1, "step": step, "config": {}, "data": {}, "world_size": 1, "parallel": {}
    }  # fmt: skip
    files.write_shard(files.tmp_dir(root, step), 0, "run", {"w": torch.full((2,), value)})
    return files.publish(root, step, 1, "run", manifest, keep_last=3)


def test_replacing_a_step_never_loses_it(tmp_path: Path, monkeypatch) -> None:
    """Saving a step again (after a rewind) swaps folders by renames; a save that dies between
    them leaves the previous checkpoint in ``.old-step-*``, which the next start puts back."""
    from mt_train.checkpoint import files

    root = tmp_path / "checkpoints"
    _save(root, 4, 1.0)
    assert CheckpointReader(_save(root, 4, 2.0)).read(["w"])["w"].tolist() == [2.0, 2.0]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004"]  # no .old left

    real_rename = os.rename

    def die_before_publishing(src, dst):
        if Path(src).name.startswith(".tmp-step-"):
            raise KeyboardInterrupt  # killed between the two renames
        real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", die_before_publishing)
    with pytest.raises(KeyboardInterrupt):
        _save(root, 4, 3.0)
    monkeypatch.setattr(files.os, "rename", real_rename)
    assert list_checkpoints(root) == []  # step 4 is only under .old-step-00000004 now
    files.restore_replaced(root)
    assert CheckpointReader(list_checkpoints(root)[0]).read(["w"])["w"].tolist() == [2.0, 2.0]
    files.remove_stale(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004"]
