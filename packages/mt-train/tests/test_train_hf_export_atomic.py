"""A killed ``mt-convert export`` (``HFWriter.close``) leaves the previous export or the new
one: a kill before each file-system step of publishing (every ``os.replace``, deletion and
folder creation), then :func:`restore_interrupted_export` (itself killed before each of its
steps and run again), leaves the folder's files byte for byte those of exactly one of the two
exports, the other files kept; a marker in the folder before the restore already means a
whole export. A failed publish's ``discard``, the next writer and ``mt-convert import``
restore the previous export."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_train_convert_export_streaming import _save

from mt_train.checkpoint.files import CheckpointReader, checkpoint_folder
from mt_train.hf_checkpoints import export_hf, import_hf
from mt_train.hf_shards import MARKERS, HFShards, HFWriter, restore_interrupted_export
from mt_train.models import model_sizes
from mt_train.models.build import build_model


class Killed(BaseException):
    """A kill: no ``except Exception`` cleanup runs."""


@contextlib.contextmanager
def faults(monkeypatch: pytest.MonkeyPatch, at: int, error: type[BaseException] = Killed):
    """Raise ``error`` before the ``at``-th file-system step (0-based) inside the block and
    before every later one, as a kill stops everything; yields the steps taken."""
    steps: list[str] = []

    def step(name: str, run):
        def faulty(*args, **kwargs):
            if len(steps) == at:
                raise error(f"fault before step {at} ({name})")
            steps.append(name)
            return run(*args, **kwargs)

        return faulty

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", step("replace", os.replace))
        patch.setattr(shutil, "rmtree", step("rmtree", shutil.rmtree))
        for name in ("unlink", "rmdir", "mkdir"):
            patch.setattr(Path, name, step(name, getattr(Path, name)))
        yield steps


EXPORTS = {  # tensors per file; one file: model.safetensors, else parts and an index
    "three": [["a", "b"], ["c"], ["d"]],
    "two": [["a"], ["b", "c", "e"]],
    "one": [["a", "b", "f"]],
}


def write_export(folder: Path, layout: str, seed: int) -> None:
    plan = EXPORTS[layout]
    writer = HFWriter(folder, plan)
    g = torch.Generator().manual_seed(seed)
    writer.add({n: torch.randn(3, generator=g) for names in plan for n in names})
    writer.close({"layout": layout, "seed": seed})


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def publish_steps(tmp_path: Path, before: str | None, after: str) -> int:
    """The file-system steps of an uninterrupted close from ``before`` to ``after``."""
    folder = tmp_path / "count"
    if before is not None:
        write_export(folder, before, 0)
    plan = EXPORTS[after]
    writer = HFWriter(folder, plan)
    writer.add({n: torch.zeros(3) for names in plan for n in names})
    with faults(pytest.MonkeyPatch(), -1) as steps:
        writer.close({})
    shutil.rmtree(folder)
    return len(steps)


def killed_publish(
    folder: Path, before: str | None, after: str, at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``folder`` holding ``before`` (and a tokenizer), then ``after``'s close killed
    before step ``at``."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    if before is not None:
        write_export(folder, before, 0)
    writer = HFWriter(folder, EXPORTS[after])
    g = torch.Generator().manual_seed(1)
    writer.add({n: torch.randn(3, generator=g) for names in EXPORTS[after] for n in names})
    with faults(monkeypatch, at):
        writer.close({"layout": after, "seed": 1})


@pytest.fixture
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    # A process kill loses nothing fsync would keep; the hundreds of exports below skip it.
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def outcome(folder: Path, reference: dict[str, dict[str, bytes]]) -> str:
    """Which export ``folder`` holds, byte for byte (the test fails on anything else)."""
    files = files_of(folder)
    match = [name for name, want in reference.items() if files == want]
    assert match, (sorted(files), {k: sorted(v) for k, v in reference.items()})
    assert not list(folder.glob(".prev-export-*"))
    return match[0]


@pytest.mark.parametrize(
    ("before", "after"), [("three", "two"), ("two", "three"), ("three", "one"), ("one", "two"),
                          (None, "three")],
)  # fmt: skip
def test_a_kill_at_any_step_leaves_the_previous_export_or_the_new_one(
    before: str | None, after: str, tmp_path: Path, monkeypatch, no_fsync
) -> None:
    reference = {}
    for name, layout, seed in (("previous", before, 0), ("new", after, 1)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text("{}")
        if layout is not None:
            write_export(folder, layout, seed)
        reference[name] = files_of(folder)
    n = publish_steps(tmp_path, before, after)
    killed, state = tmp_path / "killed", tmp_path / "state"
    outcomes = []
    for at in range(n + 1):  # at == n: no kill, the close runs to its end
        with pytest.raises(Killed) if at < n else contextlib.nullcontext():
            killed_publish(killed, before, after, at, monkeypatch)
        if any((killed / m).is_file() for m in MARKERS):  # loadable before any restore
            assert files_of(killed) in (reference["previous"], reference["new"])
        # The restore, killed before each of its steps, then run again.
        for kill_restore_at in range(100):
            shutil.rmtree(state, ignore_errors=True)
            shutil.copytree(killed, state)
            with faults(monkeypatch, kill_restore_at) as steps, contextlib.suppress(Killed):
                restore_interrupted_export(state)
            restore_interrupted_export(state)
            result = outcome(state, reference)
            if kill_restore_at == 0:
                outcomes.append(result)
            assert result == outcomes[-1], (at, kill_restore_at)
            if len(steps) < kill_restore_at:  # the restore ran to its end
                break
        # The next export's writer restores it too.
        shutil.rmtree(state)
        shutil.copytree(killed, state)
        HFWriter(state, EXPORTS["one"]).discard()
        assert outcome(state, reference) == outcomes[-1]
    # The previous export until the new marker is published, then the new one.
    first_new = outcomes.index("new")
    assert first_new > 0 and outcomes == ["previous"] * first_new + ["new"] * (n + 1 - first_new)
    with HFShards(state) as shards:  # the last state: the new export, whole
        assert sorted(shards.names) == sorted(n for f in EXPORTS[after] for n in f)


def test_a_failed_publish_is_undone_by_discard(tmp_path: Path, monkeypatch, no_fsync) -> None:
    n = publish_steps(tmp_path, "three", "two")
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "tokenizer.json").write_text("{}")
    write_export(previous, "three", 0)
    folder = tmp_path / "out"
    results = []
    for at in range(n):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(previous, folder)
        writer = HFWriter(folder, EXPORTS["two"])
        writer.add({k: torch.ones(3) for f in EXPORTS["two"] for k in f})
        with pytest.raises(OSError, match="fault before step"), faults(monkeypatch, at, OSError):
            writer.close({})
        writer.discard()
        names = sorted(p.name for p in folder.iterdir())
        results.append(files_of(folder) == files_of(previous))
        assert not any(name.startswith((".prev-export-", ".tmp-export-")) for name in names)
        if not results[-1]:  # only once the new marker is in: the new export, whole
            assert names == ["config.json", "model-00001-of-00002.safetensors",
                             "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                             "tokenizer.json"]  # fmt: skip
    # The previous export until the new marker is published (then only deletions are left).
    first_new = results.index(False)
    assert first_new > 0 and results == [True] * first_new + [False] * (n - first_new)


def test_import_reads_the_previous_export_of_a_killed_one(tmp_path: Path, monkeypatch) -> None:
    sizes = model_sizes()
    cfg = dataclasses.replace(sizes["debug"], vocab_size=64, dim=32, n_layers=2, ffn_dim=64)
    roots = []
    for seed in (0, 1):
        state = build_model(cfg, "cpu", seed=seed).state_dict()
        roots.append(
            _save(tmp_path / f"mt{seed}", cfg, {f"model/{k}": v for k, v in state.items()})
        )
    folder = tmp_path / "hf"
    export_hf(roots[0], folder, max_file_bytes=20_000)
    assert (folder / "model.safetensors.index.json").is_file()
    # Killed after the previous export went to the backup and one new part came in: the
    # steps are the writer's two folders, the backup's, the previous files' moves, its rename.
    n_previous = len([*folder.glob("model-*.safetensors")]) + 2  # parts, index, config
    with pytest.raises(Killed), faults(monkeypatch, 2 + 1 + n_previous + 1 + 1):
        export_hf(roots[1], folder, max_file_bytes=20_000)
    assert not any((folder / m).is_file() for m in MARKERS)
    assert len([*folder.glob(".prev-export-*[!g]")]) == 1  # the backup, filled
    assert len([*folder.glob("model-*.safetensors")]) == 1  # the new export's first part
    import_hf(folder, tmp_path / "back", log=lambda line: None)
    back = CheckpointReader(checkpoint_folder(tmp_path / "back"))
    want = CheckpointReader(checkpoint_folder(roots[0]))
    names = want.names("model/")
    assert sorted(back.names("model/")) == sorted(names)
    got, expected = back.read(names), want.read(names)
    for name in names:
        assert torch.equal(got[name], expected[name]), name
