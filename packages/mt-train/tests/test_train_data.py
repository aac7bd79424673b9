"""Data preparation, packing and the deterministic, resumable, DP-aware sampler."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from mt_train.data import ByteTokenizer, PackedDataset, ResumableSampler, load_tokenizer
from mt_train.data.prepare import main as prepare_main
from mt_train.data.prepare import write_prepared


def test_bundled_corpus_prepared_as_chapters(kjv_data: Path) -> None:
    meta = json.loads((kjv_data / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["dtype"] == "uint16"
    docs = meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]
    assert docs == 1189  # chapters of the King James Bible
    assert meta["splits"]["val"]["documents"] == 1189 // 50
    tokens = np.fromfile(kjv_data / "train.bin", dtype=np.uint16)
    starts = np.fromfile(kjv_data / "train.idx", dtype=np.int64)
    assert starts[-1] == len(tokens)
    assert (tokens[starts[1:] - 1] == ByteTokenizer.eos_id).all()  # every document ends in EOS
    first = ByteTokenizer().decode(tokens[: starts[1]].tolist())
    assert first.startswith("Genesis 1\n") and "In the beginning God created" in first


def test_packed_windows_shift_by_one(kjv_data: Path) -> None:
    ds = PackedDataset(kjv_data, "train", seq_len=32)
    batch = ds.collate(np.array([0, 5]))
    assert batch.inputs.shape == (2, 32)
    assert (batch.inputs[:, 1:] == batch.targets[:, :-1]).all()
    raw = np.asarray(ds.tokens[5 * 32 : 5 * 32 + 33], dtype=np.int64)
    assert batch.inputs[1].tolist() == raw[:-1].tolist()


def test_document_ids_change_right_after_each_eos(tmp_path: Path) -> None:
    docs = ["a" * n for n in (5, 17, 3, 40, 9, 26, 11, 30)]  # short: many boundaries per window
    write_prepared(tmp_path, docs, ByteTokenizer(), val_every=8)
    ds = PackedDataset(tmp_path, "train", seq_len=16)
    batch = ds.collate(np.arange(len(ds)), documents=True)
    assert batch.document_ids is not None and batch.document_ids.shape == batch.inputs.shape
    assert (batch.document_ids[:, 0] == 0).all()  # renumbered per row
    # A new document starts exactly at the token after an EOS (the EOS stays in its document).
    new_doc = batch.document_ids[:, 1:] != batch.document_ids[:, :-1]
    assert (new_doc == (batch.inputs[:, :-1] == ByteTokenizer.eos_id)).all()
    assert new_doc.sum() >= 5
    assert ds.collate(np.arange(2)).document_ids is None


def test_sampler_is_deterministic_resumable_and_dp_invariant() -> None:
    def steps(sampler: ResumableSampler, n: int) -> list[list[int]]:
        return [np.concatenate(sampler.next_step()).tolist() for _ in range(n)]

    single = ResumableSampler(100, seed=7, global_batch=8, micro_batch=2)
    reference = steps(single, 30)  # crosses two epoch boundaries
    assert reference == steps(ResumableSampler(100, seed=7, global_batch=8, micro_batch=2), 30)
    first_epoch = sorted(i for step in reference[:12] for i in step)[:96]
    assert len(set(first_epoch)) == 96  # no repeats inside an epoch

    resumed = ResumableSampler(100, seed=7, global_batch=8, micro_batch=2)
    resumed.load_state_dict({"consumed": 8 * 11, "seed": 7, "global_batch": 8})
    assert steps(resumed, 19) == reference[11:]

    ranks = [ResumableSampler(100, 7, 8, 2, dp_rank=r, dp_size=2) for r in range(2)]
    for step in reference:
        union = sorted(i for r in ranks for i in np.concatenate(r.next_step()).tolist())
        assert union == sorted(step)


def test_prepare_cli_trains_bpe_on_jsonl(tmp_path: Path) -> None:
    with gzip.open(Path(__file__).parents[1] / "src/mt_train/corpus/kjv.txt.gz", "rt") as f:
        text = f.read(200_000)
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    out = tmp_path / "prepared"
    assert (
        prepare_main([str(src), "--out", str(out), "--vocab-size", "512", "--val-every", "10"]) == 0
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json" and meta["vocab_size"] == 512
    tok = load_tokenizer(out, meta["tokenizer"], meta["eos_token"])
    ids = tok.encode("And God said, Let there be light")
    assert tok.decode(ids) == "And God said, Let there be light"
    assert len(ids) < 20  # merges learned: far fewer ids than bytes
    ds = PackedDataset(out, "val", seq_len=16)
    assert len(ds) > 0

    # An existing tokenizer.json is reused as is.
    again = tmp_path / "reused"
    args = [str(src), "--out", str(again), "--tokenizer", str(out / "tokenizer.json")]
    assert prepare_main([*args, "--val-every", "10"]) == 0
    assert (again / "train.bin").read_bytes() == (out / "train.bin").read_bytes()


def test_prepare_cli_reports_bad_input(tmp_path: Path, capsys) -> None:
    assert prepare_main([str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mt-prepare-data: error: ") and "missing.txt" in err
