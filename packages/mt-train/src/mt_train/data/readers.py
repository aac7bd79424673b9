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
"""

from __future__ import annotations

import gzip
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
        self.reason = reason


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


def _decode(path: Path, number: int, line: bytes) -> str | BadRecord:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        return BadRecord(path, number, f"invalid UTF-8 at byte {err.start} of the line")


def _jsonl(path: Path, text_key: str, stats: ReadStats) -> Iterator[Record | BadRecord]:
    for number, line in _Lines(path, stats):
        text = _decode(path, number, line)
        if isinstance(text, BadRecord):
            yield text
            continue
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError as err:
            yield BadRecord(path, number, f"not JSON ({err})")
            continue
        if not isinstance(record, dict):
            yield BadRecord(path, number, f"a JSON {type(record).__name__}, not an object")
        elif text_key not in record:
            yield BadRecord(path, number, f"no field {text_key!r} (fields: {sorted(record)})")
        elif not isinstance(record[text_key], str):
            kind = type(record[text_key]).__name__
            yield BadRecord(path, number, f"field {text_key!r} is a {kind}, not a string")
        else:
            yield Record(path, number, record[text_key])


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


def read_records(
    files: Sequence[Path],
    text_key: str = "text",
    doc_start: str | None = None,
    skip_bad: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[Record]:
    """The documents of ``files`` in order (module docstring); bad records raise
    :class:`BadRecord` unless ``skip_bad`` (then they are counted in ``stats``)."""
    try:
        pattern = re.compile(doc_start) if doc_start else None
    except re.error as err:
        raise UserError(f"--doc-start {doc_start!r} is not a regular expression: {err}") from None
    stats = stats if stats is not None else ReadStats()
    for path in files:
        kind = _kind(path)
        if kind == ".parquet":
            reader = _parquet(path, text_key, stats)
        elif kind in (".jsonl", ".jsonl.gz"):
            reader = _jsonl(path, text_key, stats)
        else:
            reader = _text(path, pattern, stats)
        found = 0
        for record in reader:
            if isinstance(record, BadRecord):
                if not skip_bad:
                    raise record
                stats.bad_records += 1
                if len(stats.bad_examples) < 3:
                    stats.bad_examples.append(str(record))
                continue
            found += 1
            stats.documents += 1
            yield record
        if not found:
            message = f"{path}: no documents (an empty input)"
            if not skip_bad:
                raise UserError(message)
            stats.bad_records += 1
            if len(stats.bad_examples) < 3:
                stats.bad_examples.append(message)
