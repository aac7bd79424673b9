"""Bad input ends in one line ``<tool>: error: ...`` and exit status 2, never a traceback:
damaged data folders (checked at start-up, before any model is built), ``mt-prepare-data``
and ``mt-convert`` arguments, checkpoints of another model or none at all, unknown keys.
The matrix of cases is ``docs/reliability.md``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cli_checks import assert_one_error_line, run_cli, run_overrides, small_data

from mt_train.data.checks import check_prepared
from mt_train.data.prepare import main as prepare_main
from mt_train.errors import DataError
from mt_train.hf_checkpoints import export_hf
from mt_train.hf_checkpoints import main as convert_main

SEQ_LEN = 64


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_data(tmp_path_factory.mktemp("small") / "data")


@pytest.fixture(scope="module")
def trained(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run with checkpoints at steps 4 and 8 (not to be modified)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    from train_checks import fit, tiny_overrides

    fit(tiny_overrides(data), out)
    return out


def _meta(folder: Path, **changes: object) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    (folder / "meta.json").write_text(json.dumps(meta))


def _bytes(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(data)


def _truncate(name: str, cut: int) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / name
        path.write_bytes(path.read_bytes()[:-cut])

    return damage


def _short_train(folder: Path) -> None:  # consistent with meta.json, but < one sequence
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)[:SEQ_LEN]
    tokens.tofile(folder / "train.bin")
    np.array([0, SEQ_LEN], dtype=np.int64).tofile(folder / "train.idx")
    meta = json.loads((folder / "meta.json").read_text())
    meta["splits"]["train"] = {"tokens": SEQ_LEN, "documents": 1}
    (folder / "meta.json").write_text(json.dumps(meta))


def _token_past_vocab(folder: Path) -> None:  # an id the tokenizer does not have
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)
    tokens[100] = 300
    tokens.tofile(folder / "train.bin")
    _meta(folder, max_token_id=None)  # as a folder written by another tool: computed


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "no meta.json": (lambda f: (f / "meta.json").unlink(), "has no meta.json"),
    "meta.json not JSON": (_bytes("meta.json", b"{splits: "), "meta.json is not JSON"),
    "meta.json binary": (_bytes("meta.json", bytes(range(256))), "meta.json is not JSON"),
    "meta.json a list": (_bytes("meta.json", b"[1, 2]"), "holds a JSON list, not an object"),
    "no splits": (lambda f: _meta(f, splits=None), "lacks ['splits']"),
    "split not counts": (lambda f: _meta(f, splits={"train": 3}), "splits.train is 3"),
    "dtype uint17": (lambda f: _meta(f, dtype="uint17"), "dtype 'uint17' is not a token dtype"),
    "dtype float": (lambda f: _meta(f, dtype="float32"), "dtype 'float32' is not a token dtype"),
    "dtype uint32": (lambda f: _meta(f, dtype="uint32"), "tokens of uint32"),
    "train.bin odd bytes": (_truncate("train.bin", 1), "(truncated, appended to, or another"),
    "train.bin longer": (
        lambda f: (f / "train.bin").write_bytes((f / "train.bin").read_bytes() + b"\0\0"),
        "(truncated, appended to, or another dtype)",
    ),
    "train.bin shorter than a sequence": (_short_train, "fewer than one sequence"),
    "train.idx missing": (lambda f: (f / "train.idx").unlink(), "train.idx' is missing"),
    "train.idx truncated": (_truncate("train.idx", 8), "train.idx has 120 bytes"),
    "val.bin missing": (lambda f: (f / "val.bin").unlink(), "val.bin' is missing"),
    "tokenizer missing": (
        lambda f: _meta(f, tokenizer="tokenizer.json"),
        "the tokenizer cannot be loaded: tokenizer file",
    ),
    "tokenizer garbage": (
        lambda f: (_meta(f, tokenizer="tokenizer.json"), _bytes("tokenizer.json", b"{}")(f)),
        "is not a Hugging Face tokenizer.json",
    ),
    "token id past the tokenizer": (
        _token_past_vocab,
        "holds token id 300, outside its tokenizer's 257 ids",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_data_folder_is_refused(case: str, data: Path, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    shutil.copytree(data, folder)
    damage, expected = DAMAGE[case]
    damage(folder)
    with pytest.raises(DataError) as err:
        check_prepared(folder, SEQ_LEN)
    assert expected in str(err.value)


def test_max_token_id_is_recorded_and_computed_alike(data: Path, tmp_path: Path) -> None:
    recorded = json.loads((data / "meta.json").read_text())["max_token_id"]
    assert recorded == 256  # the EOS id of the byte tokenizer ends every document
    folder = tmp_path / "data"
    shutil.copytree(data, folder)
    _meta(folder, max_token_id=None)
    assert check_prepared(folder, SEQ_LEN)["max_token_id"] == recorded


@pytest.mark.parametrize(
    ("case", "extra", "expected"),
    [
        ("no meta.json", {}, "has no meta.json; write the folder again with `mt-prepare-data`"),
        ("token id past the tokenizer", {}, "holds token id 300"),
        ("ok", {"model.vocab_size": 128}, "model.vocab_size=128 is smaller than the tokenizer"),
        ("ok", {"trainer.seq_len": 3000}, "the val split of"),
    ],
)
def test_bad_data_is_one_line_from_the_cli(
    case: str, extra: dict, expected: str, data: Path, tmp_path: Path, capsys
) -> None:
    folder = tmp_path / "data"
    shutil.copytree(data, folder)
    if case != "ok":
        DAMAGE[case][0](folder)
    status, err = run_cli(capsys, run_overrides(folder, tmp_path / "run", **extra))
    assert_one_error_line(status, err, expected)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_run_folder_that_cannot_be_created_is_refused_before_hydra_writes(
    tmp_path: Path, capsys
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    status, err = run_cli(capsys, [f"hydra.run.dir={blocker / 'run'}"])
    assert_one_error_line(status, err, "cannot write the run folder (hydra.run.dir)")
    assert "ENOTDIR" in err


def test_damaged_bundled_corpus_says_how_to_prepare_it_again(
    data: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    shutil.copytree(data, out / "data")  # as if mt-train had prepared it here
    _truncate("train.bin", 1)(out / "data")
    status, err = run_cli(capsys, run_overrides(data, out, **{"data.path": None}))
    assert_one_error_line(status, err, f"(the bundled corpus: delete {out / 'data'} to prepare")


def test_unknown_top_level_key_is_refused(capsys) -> None:
    status, err = run_cli(capsys, ["+foo=1", "+trainer.bar=2"])
    assert_one_error_line(status, err, "unknown config key(s) foo, trainer.bar")


def test_prepare_data_refuses_a_bad_regex_and_a_bad_tokenizer(tmp_path: Path, capsys) -> None:
    text = tmp_path / "in.txt"
    text.write_text("one\ntwo\n")
    capsys.readouterr()
    status = prepare_main([str(text), "--out", str(tmp_path / "o"), "--doc-start", "(unclosed"])
    assert_one_error_line(
        status, capsys.readouterr().err, "--doc-start '(unclosed' is not a", "mt-prepare-data"
    )
    (tmp_path / "tok.json").write_text("not a tokenizer")
    status = prepare_main(
        [str(text), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "tok.json")]
    )
    assert_one_error_line(
        status, capsys.readouterr().err, "is not a Hugging Face tokenizer.json", "mt-prepare-data"
    )
    assert not (tmp_path / "o" / "meta.json").exists()


def test_prepare_data_on_a_full_disk_is_one_line(tmp_path: Path, capsys) -> None:
    from mt_train import fault_points

    text = tmp_path / "in.txt"
    text.write_text("one\ntwo\nthree\n")
    fault_points.arm(disk_site="data")
    try:
        capsys.readouterr()
        status = prepare_main([str(text), "--out", str(tmp_path / "o"), "--tokenizer", "byte"])
    finally:
        fault_points.arm()
    err = capsys.readouterr().err
    assert_one_error_line(status, err, "cannot write the prepared data folder", "mt-prepare-data")
    assert "ENOSPC" in err and not (tmp_path / "o" / "meta.json").exists()


def test_convert_import_refuses_a_garbage_safetensors_file(
    trained: Path, tmp_path: Path, capsys
) -> None:
    hf = export_hf(trained / "checkpoints", tmp_path / "hf")
    (hf / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0garbage!")
    capsys.readouterr()
    status = convert_main(["import", str(hf), str(tmp_path / "mt")])
    assert_one_error_line(
        status, capsys.readouterr().err, "is not a readable safetensors", "mt-convert"
    )
    assert not (tmp_path / "mt").exists()


def _copy_run(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"model.n_layers": 3},
            "cannot be loaded into this run: the saved state has no 'model/layers.2",
        ),
        (
            {"model.dim": 32, "model.ffn_dim": 64},
            "the checkpoint's model has dim=64 (this run: 32)",
        ),
    ],
)
def test_init_from_another_shape_is_refused(
    extra: dict, expected: str, data: Path, trained: Path, tmp_path: Path, capsys
) -> None:
    args = run_overrides(
        data, tmp_path / "run", **{"checkpoint.init_from": trained / "checkpoints", **extra}
    )
    status, err = run_cli(capsys, args)
    assert_one_error_line(status, err, expected)


def test_init_from_what_is_not_a_usable_checkpoint(
    data: Path, trained: Path, tmp_path: Path, capsys
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    status, err = run_cli(
        capsys, run_overrides(data, tmp_path / "a", **{"checkpoint.init_from": empty})
    )
    assert_one_error_line(status, err, "is neither an mt checkpoint nor a folder of them")

    run = _copy_run(trained, tmp_path)
    shard = run / "checkpoints" / "step-00000008" / "rank-00000.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))
    status, err = run_cli(
        capsys, run_overrides(data, tmp_path / "b", **{"checkpoint.init_from": shard.parent})
    )
    assert_one_error_line(status, err, "is corrupt: sha256")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"model.n_layers": 3}, "the checkpoint's model has n_layers=2 (this run: 3)"),
        (
            {"trainer.seed": 7},
            "its data order used trainer.seed=1234, this run uses trainer.seed=7",
        ),
    ],
)
def test_resume_into_another_model_or_seed_is_refused(
    extra: dict, expected: str, data: Path, trained: Path, tmp_path: Path, capsys
) -> None:
    run = _copy_run(trained, tmp_path)
    args = run_overrides(data, run, **{"checkpoint.resume": "auto", **extra})
    status, err = run_cli(capsys, args)
    assert_one_error_line(status, err, expected)
    assert (run / "checkpoints" / "step-00000008" / "manifest.json").is_file()  # untouched


def test_resume_from_a_checkpoint_root_or_a_garbage_folder(
    data: Path, trained: Path, tmp_path: Path, capsys
) -> None:
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "notes.txt").write_text("not a checkpoint")
    args = run_overrides(data, tmp_path / "a", **{"checkpoint.resume": garbage})
    status, err = run_cli(capsys, args)
    assert_one_error_line(status, err, f"no checkpoint in {garbage}, and it refuses to start fresh")

    # The checkpoint root, as init_from accepts it: its newest checkpoint that verifies.
    root = _copy_run(trained, tmp_path) / "checkpoints"
    args = run_overrides(
        data, tmp_path / "b", **{"checkpoint.resume": root, "trainer.max_steps": 10}
    )
    status, err = run_cli(capsys, args)
    assert status == 0, err[-3000:]
    assert f"resume: from {root / 'step-00000008'} (step 8)" in err
