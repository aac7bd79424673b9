"""Streaming ``mt-prepare-data``: bounded memory, same tokens as whole-file reading, process
pool order, atomic publication, bad records, progress output."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from mt_train.data import ByteTokenizer, bundled_corpus, prepare, readers
from mt_train.data.checks import check_prepared
from mt_train.data.prepare import main as prepare_main
from mt_train.data.prepare import prepare_files, read_documents, write_prepared
from mt_train.data.progress import Progress
from mt_train.data.readers import (
    BadRecord,
    ReadStats,
    Tally,
    input_files,
    jsonl_text,
    parse_chunk,
    read_chunks,
    read_records,
)
from mt_train.errors import DataError

CORPUS_MB = 8


def _write_jsonl(path: Path, megabytes: int) -> int:
    """``megabytes`` MB of JSONL (1 KB documents); returns the number of documents."""
    line = json.dumps({"text": "word " * 200}) + "\n"
    count = megabytes * (1 << 20) // len(line)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt") as f:
        for _ in range(count):
            f.write(line)
    return count


@pytest.mark.parametrize("name", ["big.jsonl", "big.jsonl.gz", "big.txt"])
def test_readers_never_hold_a_whole_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name.endswith(".txt"):
        path.write_text(("Chapter 1\n" + "word " * 200 + "\n") * (CORPUS_MB * 1000))
    else:
        _write_jsonl(path, CORPUS_MB)
    for read in (
        lambda: read_records([path], doc_start="Chapter"),
        lambda: read_chunks([path], doc_start="Chapter", chunk_bytes=1 << 16),
    ):
        tracemalloc.start()
        try:
            pieces = sum(1 for _ in read())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert pieces > 100
        # A reader that read the file whole would hold at least its size (8 MB of text); one
        # line, one 1 KB document or one 64 KB chunk at a time, plus the 128 KB gzip buffer,
        # stays far below.
        assert peak < (1 << 20), f"peak {peak} bytes while reading {path.stat().st_size}"


def test_writer_memory_does_not_grow_with_the_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "BATCH_CHARS", 1 << 14)
    peaks = []
    for megabytes in (1, 4):
        src = tmp_path / f"c{megabytes}.jsonl"
        _write_jsonl(src, megabytes)
        tracemalloc.start()
        try:
            write_prepared(tmp_path / f"o{megabytes}", read_documents([src]), ByteTokenizer(), 10)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        peaks.append(peak)
    # Four times the corpus may not cost more memory: the batch, not the corpus, bounds it
    # (a 25% allowance covers allocator noise; holding the corpus would add ≥ 3 MB).
    assert peaks[1] < 1.25 * peaks[0] + (64 << 10), peaks


def _whole_file_chapters() -> list[str]:
    """The bundled corpus split into chapters by reading it whole (the pre-streaming way)."""
    text = gzip.decompress(bundled_corpus().read_bytes()).decode("utf-8")
    pattern = re.compile(prepare.KJV_CHAPTER, re.MULTILINE)
    starts = [m.start() for m in pattern.finditer(text)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def test_bundled_corpus_tokens_equal_whole_file_reading(
    kjv_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = tmp_path / "reference"
    write_prepared(reference, iter(_whole_file_chapters()), ByteTokenizer(), 50)
    monkeypatch.setattr(prepare, "BATCH_CHARS", 1 << 16)  # many batches through the pool
    pooled = tmp_path / "pooled"
    docs = read_documents([bundled_corpus()], doc_start=prepare.KJV_CHAPTER)
    write_prepared(pooled, docs, ByteTokenizer(), 50, workers=2)
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        expected = (reference / name).read_bytes()
        assert (kjv_data / name).read_bytes() == expected, name
        assert (pooled / name).read_bytes() == expected, name


class _FailingTokenizer(ByteTokenizer):
    """Fails on its third batch, after checking that nothing is published yet."""

    def __init__(self, out: Path) -> None:
        self.out, self.calls = out, 0

    def encode_batch(self, texts):
        self.calls += 1
        if self.calls == 3:
            partial = next(self.out.parent.glob(f".{self.out.name}.partial-*"))
            assert (partial / "train.bin").stat().st_size > 0  # tokens are being written
            assert not (partial / "meta.json").exists()
            raise KeyboardInterrupt  # as a Ctrl-C or a kill at this point would
        return super().encode_batch(texts)


def test_an_interrupted_prepare_leaves_nothing_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "BATCH_CHARS", 100)
    docs = [f"document {i} " * 20 for i in range(50)]
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        write_prepared(out, iter(docs), _FailingTokenizer(out), 5)
    assert not out.exists()
    with pytest.raises(DataError, match="is not a folder"):
        check_prepared(out, 8)
    assert list(tmp_path.iterdir()) == []  # the partial folder is removed

    # Over an existing prepared folder, an interrupted rewrite keeps the old one whole.
    write_prepared(out, iter(docs), ByteTokenizer(), 5)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        write_prepared(out, iter(docs[::-1]), _FailingTokenizer(out), 5)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    check_prepared(out, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_killed_prepares_partial_folder_is_removed_by_the_next_run(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A run SIGKILLed while building leaves its partial sibling; the next build of the same
    ``out`` on this host removes it (and says so), but not a live process's nor another
    host's."""
    import socket

    out = tmp_path / "out"
    killed = subprocess.Popen(
        [sys.executable, "-c", (
            "import os, signal, sys\n"
            "from pathlib import Path\n"
            "from mt_train.data.publish import building\n"
            "with building(Path(sys.argv[1])) as partial:\n"
            "    (partial / 'train.bin').write_bytes(b'half')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
        ), str(out)],
    )  # fmt: skip
    assert killed.wait() == -9
    host = socket.gethostname()
    stale = tmp_path / f".out.partial-{host}-{killed.pid}"
    assert (stale / "train.bin").read_bytes() == b"half"
    live = tmp_path / f".out.partial-{host}-{os.getppid()}"  # pytest's parent: running
    elsewhere = tmp_path / f".out.partial-otherhost-{killed.pid}"
    for folder in (live, elsewhere):
        folder.mkdir()
    write_prepared(out, iter([f"document {i} " * 5 for i in range(6)]), ByteTokenizer(), 2)
    check_prepared(out, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name, elsewhere.name])
    assert f"removed {stale}" in capsys.readouterr().err


def test_prepare_refuses_to_replace_a_folder_that_is_not_prepared_data(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.md").write_text("keep me")
    assert prepare_main([str(src), "--out", str(out), "--tokenizer", "byte", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a prepared data folder" in err and len(err.splitlines()) == 1
    assert (out / "notes.md").read_text() == "keep me"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"text": "fine"\n', "2: not JSON"),
        (b'{"body": "x"}\n', "2: no field 'text' (fields: ['body'])"),
        (b'{"text": 3}\n', "2: field 'text' is a int, not a string"),
        (b'{"text": "caf\xe9"}\n', "2: invalid UTF-8 at byte 13 of the line"),
    ],
)
def test_a_bad_record_is_one_line_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, line: bytes, reason: str
) -> None:
    src = tmp_path / "docs.jsonl"
    good = [json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(6)]
    src.write_bytes(b"".join([good[0], line, *good[1:]]))
    args = [str(src), "--out", str(tmp_path / "o"), "--tokenizer", "byte", "--val-every", "3"]
    assert prepare_main([*args, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mt-prepare-data: error: {src}:{reason}")
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()

    assert prepare_main([*args, "--quiet", "--skip-bad-records"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 bad records" in out and f"{src}:{reason}" in out
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["skipped_records"] == 1
    assert sum(s["documents"] for s in meta["splits"].values()) == 6


def _mixed_inputs(folder: Path) -> list[Path]:
    """JSONL (plain and gzip) with blank and bad lines of every kind, an empty shard and a text
    file split by ``doc_start``: what both ways of reading must agree on."""
    lines = []
    for i in range(60):
        lines.append(json.dumps({"text": f"document {i} " + "é " * (i % 7)}).encode() + b"\n")
        if i % 9 == 4:
            lines.append(b"\n")
    for at, bad in [(3, b'{"text": "cut\n'), (17, b"[1, 2]\n"), (30, b'{"body": 1}\n'),
                    (41, b'{"text": null}\n'), (52, b'{"text": "caf\xe9"}\n')]:  # fmt: skip
        lines.insert(at, bad)
    (folder / "a.jsonl").write_bytes(b"".join(lines))
    with gzip.open(folder / "b.jsonl.gz", "wb") as f:
        f.write(b"".join(lines[::-1]).rstrip(b"\n"))  # the last line without its newline
    (folder / "c.jsonl").write_bytes(b"\n\n")
    (folder / "d.txt").write_bytes(b"preface\nChapter 1\nword\n\xffbad\nChapter 2\nmore\n")
    return input_files([folder])


def test_chunked_parsing_equals_in_process_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _mixed_inputs(tmp_path)
    expected_stats = ReadStats()
    records = read_records(files, doc_start="Chapter", skip_bad=True, stats=expected_stats)
    expected = [r.text for r in records]
    assert expected_stats.bad_records == 2 * 5 + 1 + 1  # 5 bad lines twice, a bad byte, c.jsonl
    for chunk_bytes in (64, 1 << 20):  # lines split over many chunks, and one chunk a file
        stats = ReadStats()
        tally, texts = Tally(stats, skip_bad=True), []
        for chunk in read_chunks(files, "text", "Chapter", stats, chunk_bytes=chunk_bytes):
            parsed, bad = parse_chunk(chunk, "text")
            tally.add(chunk, len(parsed), bad)
            texts.extend(parsed)
        assert texts == expected
        assert (stats.bad_records, stats.documents) == (expected_stats.bad_records, len(expected))
        assert stats.bad_examples == expected_stats.bad_examples
        assert stats.bytes_read == expected_stats.bytes_read

    # Through the pool: the same token files as the in-process reader's documents.
    monkeypatch.setattr(prepare, "BATCH_CHARS", 100)
    reference = tmp_path / "reference"
    write_prepared(reference, iter(expected), ByteTokenizer(), 5)
    pooled_stats = ReadStats()
    pooled = tmp_path / "pooled"
    prepare_files(pooled, files, ByteTokenizer(), 5, workers=2, doc_start="Chapter",
                  skip_bad=True, stats=pooled_stats)  # fmt: skip
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        assert (pooled / name).read_bytes() == (reference / name).read_bytes(), name
    assert pooled_stats.bad_examples == expected_stats.bad_examples


class _SlowOnMarker(ByteTokenizer):
    """Sleeps on the batch holding the document ``slow``, so later batches finish first."""

    def encode_batch(self, texts):
        if "slow" in texts:
            time.sleep(0.5)
        return super().encode_batch(texts)


def test_a_bad_record_in_a_worker_is_reported_first_in_input_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "BATCH_CHARS", 64)  # three or four lines a chunk
    lines = [json.dumps({"text": "slow" if i == 0 else f"doc {i}"}) + "\n" for i in range(40)]
    lines[2] = '{"text": "first bad"\n'  # line 3, in the slow first chunk
    lines[30] = "not json\n"  # line 31, in a chunk that finishes long before
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(lines))
    with pytest.raises(BadRecord) as caught:
        prepare_files(tmp_path / "out", [src], _SlowOnMarker(), 5, workers=2)
    assert str(caught.value).startswith(f"{src}:3: not JSON")
    assert not (tmp_path / "out").exists()

    stats = ReadStats()
    meta = prepare_files(tmp_path / "out", [src], _SlowOnMarker(), 5, workers=2, skip_bad=True,
                         stats=stats)  # fmt: skip
    assert stats.bad_examples[0].startswith(f"{src}:3: not JSON")
    assert stats.bad_examples[1].startswith(f"{src}:31: not JSON")
    assert meta["skipped_records"] == 2 and stats.documents == 38


def _raw_utf8_jsonl() -> bytes:
    """JSONL written as raw UTF-8: multi-byte characters, a combining accent, U+2028 and U+0085
    (line breaks to ``str.splitlines``, not to a byte reader), a BOM; CRLF and LF endings,
    blank and whitespace-only lines, an empty document, one line longer than many chunks, a
    character cut short on line 31 and a last line without its newline."""
    pieces = ["日本語", "😀 👩‍👩‍👧", "e\u0301", "a\u2028b\u0085c", "\ufeffbom", 'tab\t"q"']
    lines = [
        json.dumps({"text": f"{i} " + pieces[i % 6] * (i % 5)}, ensure_ascii=False).encode()
        + (b"\r\n" if i % 4 == 0 else b"\n")
        for i in range(40)
    ]
    lines[5:5] = [b"\n", b" \t\r\n", b'{"text": ""}\n']
    lines.insert(
        20, json.dumps({"text": "long " + "日本語 😀 " * 400}, ensure_ascii=False).encode() + b"\n"
    )
    lines.insert(30, b'{"text": "\xe6\x97\xa5\xe6"}\n')
    return b"".join(lines).rstrip(b"\n")


def test_pool_workers_parse_the_jsonl_into_the_in_process_readers_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "utf8.jsonl"
    src.write_bytes(_raw_utf8_jsonl())
    # The reference is the reader that parsed in this process before parsing moved to the pool.
    reference_stats = ReadStats()
    records = read_records([src], skip_bad=True, stats=reference_stats)
    reference = tmp_path / "reference"
    write_prepared(reference, (r.text for r in records), ByteTokenizer(), 5)
    assert reference_stats.documents == 42  # 40 lines, the empty document and the long one
    assert len(reference_stats.bad_examples) == 1
    assert reference_stats.bad_examples[0].startswith(f"{src}:31: invalid UTF-8")

    parsers = tmp_path / "parsers"
    parsers.mkdir()

    def recorded(line: bytes, text_key: str) -> str | None:
        (parsers / str(os.getpid())).touch()
        return jsonl_text(line, text_key)

    monkeypatch.setattr(readers, "jsonl_text", recorded)  # inherited by the forked workers
    monkeypatch.setattr(prepare, "BATCH_CHARS", 256)
    stats = ReadStats()
    pooled = tmp_path / "pooled"
    prepare_files(pooled, [src], ByteTokenizer(), 5, workers=2, skip_bad=True, stats=stats)
    parsed_in = {int(p.name) for p in parsers.iterdir()}
    assert parsed_in and os.getpid() not in parsed_in, "this process parsed JSON lines"
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        assert (pooled / name).read_bytes() == (reference / name).read_bytes(), name
    assert stats.bad_examples == reference_stats.bad_examples
    assert stats.documents == reference_stats.documents


def test_an_empty_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert prepare_main([str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "empty.jsonl: no documents (an empty input)" in capsys.readouterr().err


def test_folders_of_gzip_shards_and_worker_counts_give_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "BATCH_CHARS", 256)
    shards = tmp_path / "shards"
    shards.mkdir()
    texts = [f"document {i}: " + "abc " * (i % 17) for i in range(300)]
    for s in range(3):
        with gzip.open(shards / f"part-{s}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts[s * 100 : (s + 1) * 100])
    assert [p.name for p in input_files([shards])] == [f"part-{s}.jsonl.gz" for s in range(3)]
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        write_prepared(out, read_documents([shards]), ByteTokenizer(), 7, workers=workers)
        outs.append({n: (out / n).read_bytes() for n in ("train.bin", "train.idx", "val.idx")})
    assert outs[0] == outs[1]
    tokens = np.frombuffer(outs[0]["train.bin"], dtype=np.uint16)
    assert ByteTokenizer().decode(tokens[: len(texts[0]) + 1].tolist()) == texts[0]


def test_progress_is_plain_lines_off_a_terminal_and_silent_when_quiet(tmp_path: Path) -> None:
    src = tmp_path / "c.jsonl"
    _write_jsonl(src, 1)
    files = input_files([src])
    for quiet in (False, True):
        stream, stats = io.StringIO(), ReadStats()
        docs = (r.text for r in read_records(files, stats=stats))
        progress = Progress(src.stat().st_size, quiet, every_s=0.0, stream=stream)
        out = tmp_path / f"o{quiet}"
        write_prepared(out, docs, ByteTokenizer(), 10, progress=progress, stats=stats)
        lines = stream.getvalue().splitlines()
        if quiet:
            assert lines == []
        else:
            assert len(lines) >= 2 and "\r" not in stream.getvalue()
            assert lines[-1].startswith("mt-prepare-data: 100.0% | ")
            assert f"| {stats.documents:,} documents |" in lines[-1]


def test_merge_concatenates_folders_and_refuses_other_tokenizers(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from mt_train.data import train_bpe

    parts = []
    for name, words in (("a", "alpha beta"), ("b", "gamma delta epsilon")):
        folder = tmp_path / name
        write_prepared(folder, [f"{words} {i}" for i in range(9)], ByteTokenizer(), 3)
        parts.append(folder)
    out = tmp_path / "merged"
    assert prepare_main(["merge", str(out), *map(str, parts)]) == 0
    meta = check_prepared(out, 4)
    for split in ("train", "val"):
        tokens = [np.fromfile(p / f"{split}.bin", dtype=np.uint16) for p in parts]
        assert (out / f"{split}.bin").read_bytes() == b"".join(t.tobytes() for t in tokens)
        offsets = [np.fromfile(p / f"{split}.idx", dtype=np.int64) for p in parts]
        expected = np.concatenate([offsets[0], offsets[1][1:] + offsets[0][-1]])
        assert np.fromfile(out / f"{split}.idx", dtype=np.int64).tolist() == expected.tolist()
        assert meta["splits"][split]["documents"] == len(expected) - 1
    merged = np.fromfile(out / "train.bin", dtype=np.uint16)
    starts = np.fromfile(out / "train.idx", dtype=np.int64)
    sixth = ByteTokenizer().decode(merged[starts[6] : starts[7]].tolist())
    assert sixth == "gamma delta epsilon 0"  # input b's first training document follows a's six

    other = tmp_path / "bpe"
    write_prepared(other, ["alpha beta"] * 9, train_bpe(["alpha beta"] * 20, 300), 3)
    capsys.readouterr()
    assert prepare_main(["merge", str(tmp_path / "bad"), str(parts[0]), str(other)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "different tokenizers" in err and str(other) in err
    assert not (tmp_path / "bad").exists()


def test_parquet_gives_the_same_tokens_as_jsonl(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from mt_train.data import readers

    monkeypatch.setattr(readers, "PARQUET_BATCH_ROWS", 7)  # many record batches
    texts = [f"document {i}: " + "xyz " * (i % 13) for i in range(100)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    table = pa.table({"id": list(range(100)), "text": texts})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=16)
    outs = {}
    for name in ("docs.jsonl", "docs.parquet"):
        out = tmp_path / f"out-{name}"
        args = [str(tmp_path / name), "--out", str(out), "--tokenizer", "byte", "--quiet"]
        assert prepare_main([*args, "--val-every", "9"]) == 0
        outs[name] = {n: (out / n).read_bytes() for n in ("train.bin", "train.idx", "val.bin")}
    assert outs["docs.jsonl"] == outs["docs.parquet"]

    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), tmp_path / "nulls.parquet")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "other.parquet")
    for name, expected in [
        ("nulls.parquet", "nulls.parquet:row 3: column 'text' is null, not a string"),
        ("other.parquet", "other.parquet has no column 'text' (columns: ['body'])"),
    ]:
        capsys.readouterr()
        args = [str(tmp_path / name), "--out", str(tmp_path / "o"), "--tokenizer", "byte"]
        assert prepare_main([*args, "--val-every", "2"]) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.splitlines()) == 1
    nulls = [str(tmp_path / "nulls.parquet"), "--out", str(tmp_path / "o"), "--tokenizer", "byte"]
    assert prepare_main([*nulls, "--val-every", "2", "--skip-bad-records", "--quiet"]) == 0
    assert "skipped 1 bad records" in capsys.readouterr().out


def test_bpe_is_trained_on_the_leading_sample_only(tmp_path: Path) -> None:
    from mt_train.data import train_bpe

    texts = [f"alpha beta {i} " * 5 for i in range(40)] + ["zebra quokka " * 50] * 40
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    sample_bytes = sum(len(t) for t in texts[:40])  # exactly the first 40 documents
    for name in ("one", "two"):
        args = [str(src), "--out", str(tmp_path / name), "--vocab-size", "300", "--quiet"]
        assert prepare_main([*args, "--bpe-sample-bytes", str(sample_bytes)]) == 0
    saved = (tmp_path / "one/tokenizer.json").read_text()
    assert saved == (tmp_path / "two/tokenizer.json").read_text()  # deterministic
    expected = train_bpe(texts[:40], 300).tokenizer.to_str()
    assert json.loads(saved)["model"] == json.loads(expected)["model"]  # the later text unseen

    # encode_batch (encode_batch_fast, no offsets) gives the ids of encode, one text at a time.
    tokenizer = train_bpe(texts[:40], 300)
    assert tokenizer.encode_batch(texts) == [tokenizer.tokenizer.encode(t).ids for t in texts]


def test_prepare_data_starts_without_torch() -> None:
    # The command's start-up was 2 s of importing torch through mt_train's exports
    # (docs/performance.md); they load on first use now, and the data modules need no torch.
    code = (
        "import sys; import mt_train.data.prepare, mt_train.data.readers;"
        "print(sorted(m for m in ('torch', 'mt_train.trainer') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_progress_redraws_one_line_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = Progress(1000, stream=stream, refresh_s=0.0)
    progress.update(10, 200, 500)
    progress.close(20, 400, 1000)
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "50.0%" in text and "100.0% | 20 documents | 400 tokens" in text


class _RecordingTokenizer(ByteTokenizer):
    """Records the characters of every ``encode_batch`` call."""

    def __init__(self) -> None:
        self.batch_chars: list[int] = []

    def encode_batch(self, texts):
        self.batch_chars.append(sum(len(t) for t in texts))
        return super().encode_batch(texts)


def test_a_chunk_is_tokenized_in_slices_with_the_ids_of_one_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prepare, "ENCODE_CHARS", 100)
    texts = ("a" * 30, "bb" * 20, "c" * 250, "", "d" * 99, "e" * 1, "f" * 60)
    tokenizer = _RecordingTokenizer()
    flat, lengths, bad = prepare._encode(readers.Chunk(None, texts=texts), tokenizer, "text")
    # Each call stays within the slice size unless it holds one longer document alone.
    assert tokenizer.batch_chars == [70, 250, 100, 60]
    whole = ByteTokenizer().encode_batch(list(texts))
    assert lengths.tolist() == [len(ids) + 1 for ids in whole]
    expected = [i for ids in whole for i in (*ids, ByteTokenizer().eos_id)]
    assert flat.tolist() == expected and bad == []
    empty, no_lengths, _ = prepare._encode(readers.Chunk(None, texts=()), tokenizer, "text")
    assert empty.size == 0 and no_lengths.size == 0
