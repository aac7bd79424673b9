"""Streaming readers of ``mt-prepare-data``'s inputs: one document at a time, never a whole file.

Inputs are files or folders of shards (every supported file below a folder, sorted by path):

* ``.jsonl`` (and ``.jsonl.gz``): one document per line, the string field ``text_key``;
* ``.parquet`` (with the optional ``pyarrow``, ``pip install 'mt-train[parquet]'``): one
  document per row, the string column ``text_key``, read one record batch at a time (never a
  whole file); a bad row is named ``file:row N`` (rows counted from 1);
* ``.txt`` (and ``.txt.gz``): with ``doc_start``, a new document begins at every line that the
  regular expression matches from its first character (``re.match`` on the line without its
  newline), and text before the first such line is a document of its own if it is not blank;
  without ``doc_start`` the whole file is one document.

Files are read line by line (``gzip`` decompressed as a stream), so the memory a reader holds
is one line, or one document of a ``.txt`` file: it does not grow with the file. Each
:class:`Record` names its file and first line, so a bad record is reported as ``file:line:
reason`` (:class:`BadRecord`): a line that is not JSON, not an object, lacks ``text_key``, whose
``text_key`` is not a string, or is not UTF-8; a file without a document is bad as a whole.
With ``skip_bad`` the reader counts bad records in :class:`ReadStats` instead of raising.
``ReadStats.bytes_read`` counts the input bytes consumed (compressed bytes for ``.gz``), which
the progress display turns into MB/s and an ETA against :func:`input_bytes`.

Two ways in, one set of rules. :func:`read_records` parses in the calling process, a record at
a time. :func:`read_chunks` is the split that ``mt-prepare-data`` runs across processes: the
reading process cuts each JSONL file into :class:`Chunk` s of whole raw lines (bytes, with the
number of the first line, gzip decompressed as a stream) without decoding them, and
:func:`parse_chunk`, run by whichever process tokenizes the chunk, decodes UTF-8, parses JSON
and picks ``text_key`` with the same per-line function :func:`read_records` uses
(:func:`jsonl_text`). ``.txt`` files (whose ``doc_start`` split is sequential) and Parquet
record batches are decoded by the reader and travel as strings. Problems travel as ``(line,
reason)`` pairs and are judged in input order by :class:`Tally`, which raises the first bad
record (or counts it with ``skip_bad``) and the empty files, so both ways report the same
``file:line: reason`` and count the same records. A file-level problem (a missing Parquet column,
a file that is not Parquet) ends the chunks with a :attr:`Chunk.fatal` message, also raised in
input order (never skipped).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from mt_train.errors import UserError

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".txt", ".txt.gz")
"""File names a folder of shards is searched for (and what a file input must end with)."""


PARQUET_BATCH_ROWS = 4096
"""Rows of a Parquet file decoded at a time."""


class BadRecord(UserError):
    """A record that cannot be read: ``file:line: reason`` (``file:row N: reason``)."""

    def __init__(self, path: Path, line: int, reason: str, unit: str = "") -> None:
        super().__init__(f"{path}:{unit}{line}: {reason}")
        self.line, self.reason, self.unit = line, reason, unit


@dataclass(frozen=True)
class Record:
    """One document and where it starts."""

    path: Path
    line: int
    text: str


@dataclass
class ReadStats:
    """What the readers have consumed so far."""

    bytes_read: int = 0
    documents: int = 0
    bad_records: int = 0
    bad_examples: list[str] = field(default_factory=list)
    """The first few bad records' messages (for the summary line)."""

    def bad(self, error: UserError, skip_bad: bool) -> None:
        """Raise ``error``, or with ``skip_bad`` count it (and keep the first few messages)."""
        if not skip_bad:
            raise error
        self.bad_records += 1
        if len(self.bad_examples) < 3:
            self.bad_examples.append(str(error))


@dataclass(frozen=True)
class Chunk:
    """Consecutive records of one file: raw JSONL lines or decoded documents (module docstring).

    ``raw`` holds whole lines (each ending in a newline except a file's last), the first being
    line ``first_line``; ``texts`` holds documents already decoded, and ``bad`` the ``(line,
    reason)`` of records the reader found bad between them. ``ends_file`` marks a file's last
    chunk (the empty-file check); ``fatal`` a file-level error, raised when the chunk is reached.
    ``path`` is ``None`` for documents given as strings (no file, no checks).
    """

    path: Path | None
    first_line: int = 1
    raw: bytes = b""
    texts: tuple[str, ...] = ()
    bad: tuple[tuple[int, str], ...] = ()
    unit: str = ""
    ends_file: bool = False
    fatal: str | None = None


def _kind(path: Path) -> str | None:
    name = path.name
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def input_files(inputs: Sequence[Path]) -> list[Path]:
    """The files to read: each file input as is, each folder's supported files sorted."""
    files: list[Path] = []
    for item in inputs:
        item = Path(item)
        if item.is_dir():
            shards = sorted(p for p in item.rglob("*") if p.is_file() and _kind(p))
            if not shards:
                raise UserError(f"input folder {str(item)!r} holds no {', '.join(SUFFIXES)} files")
            files.extend(shards)
        elif item.is_file():
            if _kind(item) is None:
                raise UserError(f"input file {str(item)!r} is not one of {', '.join(SUFFIXES)}")
            files.append(item)
        else:
            raise FileNotFoundError(f"input file {str(item)!r} does not exist")
    return files


def input_bytes(files: Sequence[Path]) -> int:
    """Total size on disk of ``files`` (what ``ReadStats.bytes_read`` counts up to)."""
    return sum(p.stat().st_size for p in files)


class _Lines:
    """Numbered lines of a file, decompressed as a stream; counts the raw bytes consumed."""

    def __init__(self, path: Path, stats: ReadStats) -> None:
        self.path, self.stats = path, stats

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        with open(self.path, "rb") as raw:
            stream: BinaryIO = gzip.GzipFile(fileobj=raw) if self.path.name.endswith(".gz") else raw
            position = 0
            for number, line in enumerate(stream, 1):
                now = raw.tell()
                self.stats.bytes_read += now - position
                position = now
                yield number, line


class BadLine(ValueError):
    """Why one line is not a document (the ``reason`` of a :class:`BadRecord`)."""


def _utf8(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadLine(f"invalid UTF-8 at byte {err.start} of the line") from None


def _decode(path: Path, number: int, line: bytes) -> str | BadRecord:
    try:
        return _utf8(line)
    except BadLine as err:
        return BadRecord(path, number, str(err))


def jsonl_text(line: bytes, text_key: str) -> str | None:
    """The ``text_key`` string of one raw JSONL line, ``None`` for a blank line; a bad line
    raises :class:`BadLine` with the reason."""
    text = _utf8(line)
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except ValueError as err:
        raise BadLine(f"not JSON ({err})") from None
    if not isinstance(record, dict):
        raise BadLine(f"a JSON {type(record).__name__}, not an object")
    if text_key not in record:
        raise BadLine(f"no field {text_key!r} (fields: {sorted(record)})")
    value = record[text_key]
    if not isinstance(value, str):
        raise BadLine(f"field {text_key!r} is a {type(value).__name__}, not a string")
    return value


def _jsonl(path: Path, text_key: str, stats: ReadStats) -> Iterator[Record | BadRecord]:
    for number, line in _Lines(path, stats):
        try:
            text = jsonl_text(line, text_key)
        except BadLine as err:
            yield BadRecord(path, number, str(err))
            continue
        if text is not None:
            yield Record(path, number, text)


def _parquet(path: Path, text_key: str, stats: ReadStats) -> Iterator[Record | BadRecord]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install 'mt-train[parquet]'") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid for a damaged file
        raise UserError(f"{path} is not a Parquet file ({err})") from None
    columns = parquet.schema_arrow.names
    if text_key not in columns:
        raise UserError(f"{path} has no column {text_key!r} (columns: {columns})")
    size, total = path.stat().st_size, max(parquet.metadata.num_rows, 1)
    row = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_key]):
        for value in batch.column(0).to_pylist():
            row += 1
            if isinstance(value, str):
                yield Record(path, row, value)
            else:
                kind = "null" if value is None else f"a {type(value).__name__}"
                yield BadRecord(path, row, f"column {text_key!r} is {kind}, not a string", "row ")
        stats.bytes_read += size * batch.num_rows // total


def _text(
    path: Path, pattern: re.Pattern[str] | None, stats: ReadStats
) -> Iterator[Record | BadRecord]:
    lines: list[str] = []
    first = 1
    for number, raw in _Lines(path, stats):
        line = _decode(path, number, raw)
        if isinstance(line, BadRecord):
            yield line  # skipped: the line is left out of its document
            continue
        if pattern is not None and pattern.match(line.rstrip("\r\n")) and lines:
            document = "".join(lines)
            if document.strip():
                yield Record(path, first, document)
            lines, first = [], number
        lines.append(line)
    document = "".join(lines)
    if document.strip() or (pattern is None and document):
        yield Record(path, first, document)


def _pattern(doc_start: str | None) -> re.Pattern[str] | None:
    try:
        return re.compile(doc_start) if doc_start else None
    except re.error as err:
        raise UserError(f"--doc-start {doc_start!r} is not a regular expression: {err}") from None


def _reader(
    path: Path, text_key: str, pattern: re.Pattern[str] | None, stats: ReadStats
) -> Iterator[Record | BadRecord]:
    kind = _kind(path)
    if kind == ".parquet":
        return _parquet(path, text_key, stats)
    if kind in (".jsonl", ".jsonl.gz"):
        return _jsonl(path, text_key, stats)
    return _text(path, pattern, stats)


def read_records(
    files: Sequence[Path],
    text_key: str = "text",
    doc_start: str | None = None,
    skip_bad: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[Record]:
    """The documents of ``files`` in order (module docstring); bad records raise
    :class:`BadRecord` unless ``skip_bad`` (then they are counted in ``stats``)."""
    pattern = _pattern(doc_start)
    stats = stats if stats is not None else ReadStats()
    for path in files:
        found = 0
        for record in _reader(path, text_key, pattern, stats):
            if isinstance(record, BadRecord):
                stats.bad(record, skip_bad)
                continue
            found += 1
            stats.documents += 1
            yield record
        if not found:
            stats.bad(UserError(f"{path}: no documents (an empty input)"), skip_bad)


def _raw_chunks(path: Path, stats: ReadStats, chunk_bytes: int) -> Iterator[Chunk]:
    """Whole raw lines of a JSONL file, about ``chunk_bytes`` at a time (a longer line whole)."""
    with open(path, "rb") as raw:
        stream: BinaryIO = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
        pending, first_line, position = bytearray(), 1, 0
        while block := stream.read(chunk_bytes):
            now = raw.tell()
            stats.bytes_read += now - position
            position = now
            searched = len(pending)
            pending += block
            cut = pending.rfind(b"\n", searched) + 1
            if cut:
                lines = bytes(pending[:cut])
                del pending[:cut]
                yield Chunk(path, first_line, raw=lines)
                first_line += lines.count(b"\n")
        if pending:
            yield Chunk(path, first_line, raw=bytes(pending))


def _text_chunks(
    path: Path, records: Iterator[Record | BadRecord], chunk_chars: int
) -> Iterator[Chunk]:
    """Documents (and bad records) decoded by a reader, about ``chunk_chars`` at a time."""
    texts: list[str] = []
    bad: list[tuple[int, str]] = []
    size, unit = 0, ""
    for record in records:
        if isinstance(record, BadRecord):
            bad.append((record.line, record.reason))
            unit = record.unit
            continue
        texts.append(record.text)
        size += len(record.text)
        if size >= chunk_chars:
            yield Chunk(path, texts=tuple(texts), bad=tuple(bad), unit=unit)
            texts, bad, size = [], [], 0
    if texts or bad:
        yield Chunk(path, texts=tuple(texts), bad=tuple(bad), unit=unit)


def read_chunks(
    files: Sequence[Path],
    text_key: str = "text",
    doc_start: str | None = None,
    stats: ReadStats | None = None,
    *,
    chunk_bytes: int,
) -> Iterator[Chunk]:
    """The records of ``files`` in order as :class:`Chunk` s of about ``chunk_bytes`` bytes
    (characters for decoded documents), each file's last marked ``ends_file`` (an empty file
    gives one empty chunk); :func:`parse_chunk` and :class:`Tally` finish the reading."""
    pattern = _pattern(doc_start)
    stats = stats if stats is not None else ReadStats()
    for path in files:
        if _kind(path) in (".jsonl", ".jsonl.gz"):
            chunks = _raw_chunks(path, stats, chunk_bytes)
        else:
            chunks = _text_chunks(path, _reader(path, text_key, pattern, stats), chunk_bytes)
        held: Chunk | None = None  # yielded once the next one shows it is not the file's last
        try:
            for chunk in chunks:
                if held is not None:
                    yield held
                held = chunk
        except UserError as err:  # the file as a whole (pyarrow missing, not Parquet, no column)
            if held is not None:
                yield held
            yield Chunk(path, fatal=str(err), ends_file=True)
            return
        yield (
            Chunk(path, ends_file=True)
            if held is None
            else dataclasses.replace(held, ends_file=True)
        )


def parse_chunk(chunk: Chunk, text_key: str) -> tuple[list[str], list[tuple[int, str]]]:
    """The documents of ``chunk`` and the ``(line, reason)`` of its bad records, in order."""
    if not chunk.raw:
        return list(chunk.texts), list(chunk.bad)
    texts: list[str] = []
    bad: list[tuple[int, str]] = []
    # Lines keep their newline, as when a file is iterated (a JSON error names the same column).
    for number, line in enumerate(io.BytesIO(chunk.raw), chunk.first_line):
        try:
            text = jsonl_text(line, text_key)
        except BadLine as err:
            bad.append((number, str(err)))
            continue
        if text is not None:
            texts.append(text)
    return texts, bad


class Tally:
    """The reader's verdicts on parsed chunks, given in input order: raises the first bad record
    (or counts it with ``skip_bad``), an empty file and a file-level error, as
    :func:`read_records` would; counts the documents of file chunks into ``stats``."""

    def __init__(self, stats: ReadStats, skip_bad: bool) -> None:
        self.stats, self.skip_bad = stats, skip_bad
        self.file_documents = 0

    def add(self, chunk: Chunk, documents: int, bad: Sequence[tuple[int, str]]) -> None:
        if chunk.path is None:
            return
        if chunk.fatal is not None:
            raise UserError(chunk.fatal)
        for line, reason in bad:
            self.stats.bad(BadRecord(chunk.path, line, reason, chunk.unit), self.skip_bad)
        self.stats.documents += documents
        self.file_documents += documents
        if chunk.ends_file:
            if not self.file_documents:
                message = f"{chunk.path}: no documents (an empty input)"
                self.stats.bad(UserError(message), self.skip_bad)
            self.file_documents = 0
