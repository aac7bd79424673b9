"""``mt-prepare-data``: text, JSONL or Parquet in, streamed; a tokenizer and memory-mapped token files out.

Output folder layout::

    meta.json        {"format": 1, "tokenizer": "byte" | "tokenizer.json", "eos_token", "eos_id",
                      "vocab_size", "max_token_id", "dtype": "uint16" | "uint32",
                      "splits": {"train": {"tokens", "documents"}, "val": {...}},
                      "skipped_records"}
    tokenizer.json   the HF tokenizer (absent for the byte tokenizer)
    train.bin        every training document's ids followed by eos_id, concatenated (dtype)
    train.idx        int64 document start offsets into train.bin, documents + 1 entries
    val.bin, val.idx the same for the validation documents

The dtype is uint16 when every id fits (vocab ≤ 65536), else uint32. Document ``d`` (in
input order, :mod:`mt_train.data.readers`) goes to validation when
``d % val_every == val_every - 1`` (spread over the corpus, not its tail), so the split is
deterministic and independent of the tokenizer and of ``--workers``.

Streaming. Input files are cut into chunks of about ``BATCH_CHARS`` bytes
(:func:`mt_train.data.readers.read_chunks`): JSONL as whole raw lines, which this process
neither decodes nor parses; ``.txt`` documents and Parquet rows as strings. Each chunk is
parsed (UTF-8, JSON, ``text_key``: :func:`mt_train.data.readers.parse_chunk`) and tokenized
by one call of :func:`_encode`, in a pool of ``workers`` processes (at most ``2·workers``
chunks in flight, results taken in submission order) or, with one worker, in this process.
The tokenizer runs on slices of at most ``ENCODE_CHARS`` characters of the chunk, whose ids
are copied out before the next slice: its per-document ``Encoding`` objects (tokens as strings,
offsets, masks) are many times the size of the ids, so each worker holds them for one slice,
not for its whole chunk. A result is the chunk's ids as one array in the
token file's dtype, the documents' lengths
and the ``(line, reason)`` of its bad records, which :class:`mt_train.data.readers.Tally`
judges in input order (the first bad record of the input stops the run, whichever worker
finished first). Results are appended to the token and offset files as they come back, so
memory is bounded by the chunks in flight, not by the corpus. Documents given as strings
(:func:`write_prepared`) take the same path in chunks of ``BATCH_CHARS`` characters.
``max_token_id`` (the largest id written) lets ``mt-train`` check the data against
``model.vocab_size`` without reading every token (:mod:`mt_train.data.checks`).

Atomicity. Everything is written into a temporary sibling folder ``.<out>.partial-<host>-<pid>``
and ``meta.json`` last; only then is the folder renamed to ``out`` (an existing prepared
folder at ``out`` is moved aside first and deleted after). An interrupted run (a kill, a full
disk, a bad record) leaves ``out`` as it was, and the partial folder is never read by
``mt-train``, which takes only the folder it is given.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from importlib import resources
from pathlib import Path

import numpy as np

from mt_train import fault_points
from mt_train.data.progress import Progress
from mt_train.data.publish import building, write_meta
from mt_train.data.readers import (
    Chunk,
    ReadStats,
    Tally,
    input_bytes,
    input_files,
    parse_chunk,
    read_chunks,
    read_records,
)
from mt_train.data.tokenizer import EOS_TOKEN, ByteTokenizer, HFTokenizer, Tokenizer, train_bpe
from mt_train.errors import UserError, report

FORMAT_VERSION = 1
KJV_CHAPTER = r"^(?:[1-3] )?[A-Z][A-Za-z ]+ [0-9]+$"
BATCH_CHARS = 1 << 20
"""Bytes of raw JSONL (characters of decoded text) per chunk, the unit of work of one pool task."""
ENCODE_CHARS = 1 << 16
"""Characters per ``encode_batch`` call inside a chunk (module docstring: bounds each worker's
memory; one document longer than this is encoded alone)."""


def read_documents(
    paths: Sequence[Path], text_key: str = "text", doc_start: str | None = None
) -> Iterator[str]:
    """The documents of ``paths`` (files or folders), streamed (:mod:`mt_train.data.readers`)."""
    return (r.text for r in read_records(input_files(paths), text_key, doc_start))


def token_dtype(tokenizer: Tokenizer) -> type:
    """``uint16`` when every id of ``tokenizer`` fits, else ``uint32``."""
    return np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32


def _string_chunks(documents: Iterable[str]) -> Iterator[Chunk]:
    """``documents`` given as strings, ``BATCH_CHARS`` characters a chunk."""
    batch: list[str] = []
    size = 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            yield Chunk(None, texts=tuple(batch))
            batch, size = [], 0
    if batch:
        yield Chunk(None, texts=tuple(batch))


_worker_tokenizer: Tokenizer | None = None
_worker_text_key = "text"


def _init_worker(tokenizer: Tokenizer, text_key: str) -> None:
    global _worker_tokenizer, _worker_text_key
    _worker_tokenizer, _worker_text_key = tokenizer, text_key


Encoded = tuple[np.ndarray, np.ndarray, list[tuple[int, str]]]
"""A chunk's ids (each document's followed by EOS, concatenated in the token file's dtype, the
smallest transfer back from a worker), each document's length, and its bad records."""


def _encode(
    chunk: Chunk, tokenizer: Tokenizer | None = None, text_key: str | None = None
) -> Encoded:
    """Parse ``chunk`` (:func:`mt_train.data.readers.parse_chunk`) and tokenize its documents;
    in a pool worker the tokenizer and ``text_key`` are the ones :func:`_init_worker` set."""
    tok = tokenizer or _worker_tokenizer
    assert tok is not None, "the pool initializer sets the tokenizer"
    texts, bad = parse_chunk(chunk, _worker_text_key if text_key is None else text_key)
    dtype = token_dtype(tok)
    pieces: list[np.ndarray] = []
    piece_lengths: list[np.ndarray] = []
    for start, stop in _slices(texts, ENCODE_CHARS):
        encoded = tok.encode_batch(texts[start:stop])
        lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
        flat = np.empty(int(lengths.sum()), dtype=dtype)
        ends = np.cumsum(lengths)
        for ids, end, length in zip(encoded, ends, lengths, strict=True):
            flat[end - length : end - 1] = ids
            flat[end - 1] = tok.eos_id
        pieces.append(flat)
        piece_lengths.append(lengths)
    if not pieces:
        return np.empty(0, dtype=dtype), np.empty(0, dtype=np.int64), bad
    return np.concatenate(pieces), np.concatenate(piece_lengths), bad


def _slices(texts: Sequence[str], max_chars: int) -> Iterator[tuple[int, int]]:
    """Consecutive ``[start, stop)`` ranges of ``texts`` of at most ``max_chars`` characters each
    (a longer text alone), covering every text once."""
    start, size = 0, 0
    for index, text in enumerate(texts):
        if size and size + len(text) > max_chars:
            yield start, index
            start, size = index, 0
        size += len(text)
    if start < len(texts):
        yield start, len(texts)


def _encoded(
    chunks: Iterable[Chunk], tokenizer: Tokenizer, text_key: str, workers: int
) -> Iterator[tuple[Chunk, Encoded]]:
    """Each chunk with its :data:`Encoded`, in input order; ``workers > 1`` parses and tokenizes
    in a process pool with at most ``2·workers`` chunks in flight (bounded memory, order kept
    by a FIFO), while this process only reads."""
    if workers <= 1:
        for chunk in chunks:
            yield chunk, _encode(chunk, tokenizer, text_key)
        return
    # NOTE: each worker tokenizes single-threaded; the variable must be set before the fork,
    # or `tokenizers` warns that parallelism was already used in the parent.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    context = multiprocessing.get_context("fork")
    try:
        with context.Pool(workers, _init_worker, (tokenizer, text_key)) as pool:
            pending: collections.deque = collections.deque()
            for chunk in chunks:
                pending.append((chunk, pool.apply_async(_encode, (chunk,))))
                if len(pending) >= 2 * workers:
                    done, result = pending.popleft()
                    yield done, result.get()
            while pending:
                done, result = pending.popleft()
                yield done, result.get()
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


class _SplitFiles:
    """``<split>.bin`` and ``<split>.idx`` of one split, appended to as documents arrive."""

    def __init__(self, folder: Path, split: str, dtype: type) -> None:
        self.split, self.dtype = split, dtype
        self.tokens_file = open(folder / f"{split}.bin", "wb")  # noqa: SIM115 (closed in close)
        self.offsets_file = open(folder / f"{split}.idx", "wb")  # noqa: SIM115
        np.zeros(1, dtype=np.int64).tofile(self.offsets_file)
        self.tokens = self.documents = 0

    def append(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        flat.astype(self.dtype, copy=False).tofile(self.tokens_file)
        (self.tokens + np.cumsum(lengths)).tofile(self.offsets_file)
        self.tokens += int(flat.size)
        self.documents += int(lengths.size)

    def close(self) -> None:
        for f in (self.tokens_file, self.offsets_file):
            f.flush()
            os.fsync(f.fileno())
            f.close()


def _write_splits(
    folder: Path,
    chunks: Iterable[Chunk],
    tokenizer: Tokenizer,
    val_every: int,
    workers: int,
    text_key: str,
    tally: Tally,
    progress: Progress | None,
) -> dict[str, object]:
    fault_points.disk_write("data", folder / "train.bin")
    dtype = token_dtype(tokenizer)
    files = {split: _SplitFiles(folder, split, dtype) for split in ("train", "val")}
    largest, seen, stats = -1, 0, tally.stats
    try:
        for chunk, (flat, lengths, bad) in _encoded(chunks, tokenizer, text_key, workers):
            tally.add(chunk, int(lengths.size), bad)
            numbers = seen + np.arange(lengths.size)
            is_val = numbers % val_every == val_every - 1
            owner = np.repeat(is_val, lengths)
            for split, mask, token_mask in (
                ("val", is_val, owner),
                ("train", ~is_val, ~owner),
            ):
                if mask.any():
                    files[split].append(flat[token_mask], lengths[mask])
            largest = max(largest, int(flat.max()) if flat.size else -1)
            seen += int(lengths.size)
            if progress is not None:
                tokens = files["train"].tokens + files["val"].tokens
                progress.update(seen, tokens, stats.bytes_read)
    finally:
        for f in files.values():
            f.close()
    for split, f in files.items():
        if not f.documents:
            raise ValueError(f"the {split} split is empty: {seen} documents, val_every={val_every}")
    if progress is not None:
        progress.close(seen, files["train"].tokens + files["val"].tokens, stats.bytes_read)
    meta: dict[str, object] = {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer.save(folder),
        "eos_token": getattr(tokenizer, "eos_token", EOS_TOKEN),
        "eos_id": tokenizer.eos_id,
        "vocab_size": tokenizer.vocab_size,
        "max_token_id": largest,
        "dtype": np.dtype(dtype).name,
        "splits": {s: {"tokens": f.tokens, "documents": f.documents} for s, f in files.items()},
        "skipped_records": stats.bad_records,
    }
    write_meta(folder, meta)
    return meta


def _publish(
    out: Path,
    chunks: Iterable[Chunk],
    tokenizer: Tokenizer,
    val_every: int,
    workers: int,
    text_key: str,
    tally: Tally,
    progress: Progress | None,
) -> dict[str, object]:
    if val_every < 2:
        raise ValueError(
            f"val_every must be >= 2 (1 would leave nothing to train on), got {val_every}"
        )
    with building(Path(out)) as partial:
        return _write_splits(
            partial, chunks, tokenizer, val_every, workers, text_key, tally, progress
        )


def write_prepared(
    out: Path,
    documents: Iterable[str],
    tokenizer: Tokenizer,
    val_every: int,
    workers: int = 1,
    progress: Progress | None = None,
    stats: ReadStats | None = None,
) -> dict[str, object]:
    """Tokenize ``documents`` (strings, streamed) and publish the folder of the module
    docstring at ``out`` atomically; ``progress`` reports the bytes ``stats`` counts."""
    tally = Tally(stats if stats is not None else ReadStats(), skip_bad=False)
    chunks = _string_chunks(documents)
    return _publish(out, chunks, tokenizer, val_every, workers, "text", tally, progress)


def prepare_files(
    out: Path,
    files: Sequence[Path],
    tokenizer: Tokenizer,
    val_every: int,
    workers: int = 1,
    text_key: str = "text",
    doc_start: str | None = None,
    skip_bad: bool = False,
    progress: Progress | None = None,
    stats: ReadStats | None = None,
) -> dict[str, object]:
    """:func:`write_prepared` for input files read by :func:`mt_train.data.readers.read_chunks`:
    this process reads raw lines, the workers parse and tokenize them (module docstring)."""
    stats = stats if stats is not None else ReadStats()
    chunks = read_chunks(files, text_key, doc_start, stats, chunk_bytes=BATCH_CHARS)
    tally = Tally(stats, skip_bad)
    return _publish(out, chunks, tokenizer, val_every, workers, text_key, tally, progress)


def bundled_corpus() -> Path:
    """Path of the King James corpus shipped in ``mt_train/corpus``."""
    return Path(str(resources.files("mt_train") / "corpus" / "kjv.txt.gz"))


def prepare_bundled(
    out: Path, val_every: int = 50, name: str = "kjv", image_tokens: int | None = None
) -> dict[str, object]:
    """A bundled set: ``kjv``, the default run's corpus (one document per chapter, byte
    tokens), ``digits`` (:mod:`mt_train.data.digits`) or ``shapes``
    (:mod:`mt_train.data.shapes`); the image sets take ``image_tokens`` per image, the
    model's."""
    if name in ("digits", "shapes"):
        from mt_train.data.digits import prepare_digits
        from mt_train.data.shapes import prepare_shapes

        if image_tokens is None:
            raise ValueError(
                f"data.bundled={name} (image captions) needs a vision-language model: model=vlm_tiny"
            )
        prepare = prepare_digits if name == "digits" else prepare_shapes
        return prepare(out, val_every, image_tokens)
    meta_path = out / "meta.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    docs = read_documents([bundled_corpus()], doc_start=KJV_CHAPTER)
    return write_prepared(out, docs, ByteTokenizer(), val_every)


def _bpe_sample(texts: Iterable[str], limit: int) -> Iterator[str]:
    """The first documents of ``texts`` up to ``limit`` UTF-8 bytes (deterministic)."""
    taken = 0
    for text in texts:
        if taken >= limit:
            return
        taken += len(text.encode("utf-8"))
        yield text


def default_workers() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        from mt_train.data.merge import merge_main

        return merge_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="mt-prepare-data",
        description="Tokenize text/JSONL (streamed) into memory-mapped token files for mt-train. "
        "`mt-prepare-data merge OUT IN...` concatenates prepared folders.",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        type=Path,
        help=".txt, .jsonl (optionally .gz), .parquet files or folders of them",
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="'bpe' (train a byte-level BPE; the default for text), 'byte' (raw bytes; the "
        "default for --image-text) or a path to a tokenizer.json",
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument(
        "--bpe-sample-bytes",
        type=_positive,
        default=1 << 30,
        help="train the BPE on the first documents up to this many bytes of text",
    )
    parser.add_argument("--eos-token", default=EOS_TOKEN, help="end-of-document token name")
    parser.add_argument(
        "--text-key", default="text", help="JSONL field or Parquet column holding the text"
    )
    parser.add_argument("--doc-start", default=None, help="regex of lines that start a document")
    parser.add_argument(
        "--val-every", type=int, default=50, help="every n-th document is validation"
    )
    parser.add_argument(
        "--workers", type=_positive, default=None, help="tokenizing processes (all cores)"
    )
    parser.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="count and report bad records instead of stopping at the first",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        help="seconds between progress lines when stderr is not a terminal",
    )
    parser.add_argument(
        "--image-text",
        action="store_true",
        help="JSONL of {image(s), prompt, text} samples (mt_train.data.image_text); byte tokens "
        "or --tokenizer tokenizer.json",
    )
    parser.add_argument("--image-shape", type=int, nargs=3, metavar=("C", "H", "W"))
    parser.add_argument(
        "--image-tokens", type=int, help="tokens per image (the model's; vlm_tiny: 4)"
    )
    parser.add_argument("--max-tokens", type=int, help="refuse samples longer than this")
    args = parser.parse_args(argv)
    if args.image_text:
        return _main_image_text(args)
    args.tokenizer = args.tokenizer or "bpe"
    stats = ReadStats()
    try:
        files = input_files(args.inputs)

        if args.tokenizer == "byte":
            tokenizer: Tokenizer = ByteTokenizer()
        elif args.tokenizer == "bpe":
            records = read_records(files, args.text_key, args.doc_start, args.skip_bad_records)
            sample = _bpe_sample((r.text for r in records), args.bpe_sample_bytes)
            tokenizer = train_bpe(sample, args.vocab_size)
        else:
            tokenizer = HFTokenizer.from_file(args.tokenizer, args.eos_token)
        progress = Progress(input_bytes(files), args.quiet, every_s=args.progress_every)
        workers = args.workers or default_workers()
        meta = prepare_files(
            args.out, files, tokenizer, args.val_every, workers, args.text_key, args.doc_start,
            args.skip_bad_records, progress, stats,
        )  # fmt: skip
    except (OSError, ValueError, UserError) as err:
        return report("mt-prepare-data", err)
    splits = meta["splits"]
    skipped = (
        f"; skipped {stats.bad_records} bad records (first: {stats.bad_examples[0]})"
        if stats.bad_records
        else ""
    )
    print(
        f"wrote {args.out}: vocab {meta['vocab_size']}, "
        + ", ".join(
            f"{k} {v['tokens']:,} tokens / {v['documents']} docs" for k, v in splits.items()
        )  # type: ignore[union-attr]
        + skipped
    )
    return 0


def _main_image_text(args: argparse.Namespace) -> int:
    from mt_train.data.image_text import read_jsonl_records, write_image_text

    if args.image_shape is None or args.image_tokens is None:
        return report(
            "mt-prepare-data", "--image-text needs --image-shape C H W and --image-tokens N"
        )
    if args.tokenizer == "bpe":
        return report(
            "mt-prepare-data",
            "--image-text takes --tokenizer byte (the default) or a tokenizer.json, not 'bpe' "
            "(train one on the text first: mt-prepare-data --tokenizer bpe writes tokenizer.json)",
        )
    try:
        tokenizer = None
        if args.tokenizer not in (None, "byte"):
            tokenizer = HFTokenizer.from_file(args.tokenizer, args.eos_token)
        meta = write_image_text(
            args.out, read_jsonl_records(args.inputs), args.image_shape, args.image_tokens,
            args.val_every, args.max_tokens, tokenizer,
        )  # fmt: skip
    except (OSError, ValueError, UserError) as err:
        return report("mt-prepare-data", err)
    splits = meta["splits"]
    print(
        f"wrote {args.out}: vocab {meta['vocab_size']}, image token {meta['image_token_id']}, "
        + ", ".join(f"{k} {v['samples']} samples / {v['images']} images" for k, v in splits.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
