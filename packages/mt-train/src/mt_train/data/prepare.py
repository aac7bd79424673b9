"""``mt-prepare-data``: text or JSONL in; a tokenizer and memory-mapped token files out.

Output folder layout::

    meta.json        {"format": 1, "tokenizer": "byte" | "tokenizer.json", "eos_token", "eos_id",
                      "vocab_size", "max_token_id", "dtype": "uint16" | "uint32",
                      "splits": {"train": {"tokens", "documents"}, "val": {...}}}
    tokenizer.json   the HF tokenizer (absent for the byte tokenizer)
    train.bin        every training document's ids followed by eos_id, concatenated (dtype)
    train.idx        int64 document start offsets into train.bin, documents + 1 entries
    val.bin, val.idx the same for the validation documents

The dtype is uint16 when every id fits (vocab ≤ 65536), else uint32. Document ``d`` goes
to validation when ``d % val_every == val_every - 1`` (spread over the corpus, not its tail),
so the split is deterministic and independent of the tokenizer. ``meta.json`` is written
last and atomically, so a folder whose preparation was interrupted (a kill, a full disk) has
none and is prepared again rather than read half-written; ``max_token_id`` (the largest id
in the token files) lets ``mt-train`` check the data against ``model.vocab_size`` at start-up
without reading every token (:mod:`mt_train.data.checks`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

import numpy as np

from mt_train import fault_points
from mt_train.data.tokenizer import EOS_TOKEN, ByteTokenizer, HFTokenizer, Tokenizer, train_bpe
from mt_train.errors import DiskError, UserError, report

FORMAT_VERSION = 1
KJV_CHAPTER = r"^(?:[1-3] )?[A-Z][A-Za-z ]+ [0-9]+$"


def _open_text(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8")


def read_documents(
    paths: Sequence[Path], text_key: str = "text", doc_start: str | None = None
) -> Iterator[str]:
    """Documents of ``.txt``/``.txt.gz`` files (split where a line matches ``doc_start``,
    else one per file) and ``.jsonl``/``.jsonl.gz`` files (one per line, field ``text_key``)."""
    try:
        pattern = re.compile(doc_start, re.MULTILINE) if doc_start else None
    except re.error as err:
        raise UserError(f"--doc-start {doc_start!r} is not a regular expression: {err}") from None
    for path in paths:
        text = _open_text(path)
        if ".jsonl" in path.suffixes:
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if text_key not in record:
                    raise ValueError(
                        f"{path}:{lineno} has no field {text_key!r} (fields: {sorted(record)})"
                    )
                yield str(record[text_key])
        elif pattern is None:
            yield text
        else:
            starts = [m.start() for m in pattern.finditer(text)] or [0]
            if starts[0] != 0 and text[: starts[0]].strip():
                starts.insert(0, 0)
            for begin, end in zip(starts, [*starts[1:], len(text)], strict=True):
                if text[begin:end].strip():
                    yield text[begin:end]


def write_prepared(
    out: Path, documents: Sequence[str], tokenizer: Tokenizer, val_every: int
) -> dict[str, object]:
    """Tokenize ``documents`` and write the folder described in the module docstring."""
    if val_every < 2:
        raise ValueError(
            f"val_every must be >= 2 (1 would leave nothing to train on), got {val_every}"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "meta.json").unlink(missing_ok=True)  # the folder is incomplete until it is back
        return _write_prepared(out, documents, tokenizer, val_every)
    except OSError as err:
        raise DiskError("the prepared data folder", err.filename or out, err) from err


def _write_prepared(
    out: Path, documents: Sequence[str], tokenizer: Tokenizer, val_every: int
) -> dict[str, object]:
    fault_points.disk_write("data", out / "train.bin")
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    splits: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for start in range(0, len(documents), 256):
        batch = documents[start : start + 256]
        for d, ids in enumerate(tokenizer.encode_batch(batch), start):
            split = "val" if d % val_every == val_every - 1 else "train"
            splits[split].append(np.asarray([*ids, tokenizer.eos_id], dtype=dtype))
    meta: dict[str, object] = {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer.save(out),
        "eos_token": getattr(tokenizer, "eos_token", EOS_TOKEN),
        "eos_id": tokenizer.eos_id,
        "vocab_size": tokenizer.vocab_size,
        "max_token_id": max(
            (int(a.max()) for arrays in splits.values() for a in arrays), default=-1
        ),
        "dtype": np.dtype(dtype).name,
        "splits": {},
    }
    for split, arrays in splits.items():
        if not arrays:
            raise ValueError(
                f"the {split} split is empty: {len(documents)} documents, val_every={val_every}"
            )
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        np.concatenate(arrays).tofile(out / f"{split}.bin")
        offsets.tofile(out / f"{split}.idx")
        meta["splits"][split] = {"tokens": int(offsets[-1]), "documents": len(arrays)}  # type: ignore[index]
    partial = out / ".tmp-meta.json"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, out / "meta.json")
    return meta


def bundled_corpus() -> Path:
    """Path of the King James corpus shipped in ``mt_train/corpus``."""
    return Path(str(resources.files("mt_train") / "corpus" / "kjv.txt.gz"))


def prepare_bundled(
    out: Path, val_every: int = 50, name: str = "kjv", image_tokens: int | None = None
) -> dict[str, object]:
    """A bundled set: ``kjv``, the default run's corpus (one document per chapter, byte
    tokens), or ``digits`` (:mod:`mt_train.data.digits`; ``image_tokens`` per image, the
    model's)."""
    if name == "digits":
        from mt_train.data.digits import prepare_digits

        if image_tokens is None:
            raise ValueError(
                "data.bundled=digits (image captions) needs a vision-language model: model=vlm_tiny"
            )
        return prepare_digits(out, val_every, image_tokens)
    meta_path = out / "meta.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    docs = list(read_documents([bundled_corpus()], doc_start=KJV_CHAPTER))
    return write_prepared(out, docs, ByteTokenizer(), val_every)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mt-prepare-data",
        description="Tokenize text/JSONL into memory-mapped token files for mt-train.",
    )
    parser.add_argument("inputs", nargs="+", type=Path, help=".txt, .jsonl (optionally .gz) files")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--tokenizer",
        default="bpe",
        help="'bpe' (train a byte-level BPE), 'byte' (raw bytes) or a path to a tokenizer.json",
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument("--eos-token", default=EOS_TOKEN, help="end-of-document token name")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--doc-start", default=None, help="regex of lines that start a document")
    parser.add_argument(
        "--val-every", type=int, default=50, help="every n-th document is validation"
    )
    parser.add_argument(
        "--image-text",
        action="store_true",
        help="JSONL of {image(s), prompt, text} samples (mt_train.data.image_text); byte tokens",
    )
    parser.add_argument("--image-shape", type=int, nargs=3, metavar=("C", "H", "W"))
    parser.add_argument(
        "--image-tokens", type=int, help="tokens per image (the model's; vlm_tiny: 4)"
    )
    parser.add_argument("--max-tokens", type=int, help="refuse samples longer than this")
    args = parser.parse_args(argv)
    if args.image_text:
        return _main_image_text(args)
    try:
        docs = list(read_documents(args.inputs, args.text_key, args.doc_start))
        if args.tokenizer == "byte":
            tokenizer: Tokenizer = ByteTokenizer()
        elif args.tokenizer == "bpe":
            tokenizer = train_bpe(docs, args.vocab_size)
        else:
            tokenizer = HFTokenizer.from_file(args.tokenizer, args.eos_token)
        meta = write_prepared(args.out, docs, tokenizer, args.val_every)
    except (OSError, ValueError, UserError) as err:
        return report("mt-prepare-data", err)
    splits = meta["splits"]
    print(
        f"wrote {args.out}: vocab {meta['vocab_size']}, "
        + ", ".join(
            f"{k} {v['tokens']:,} tokens / {v['documents']} docs" for k, v in splits.items()
        )  # type: ignore[union-attr]
    )
    return 0


def _main_image_text(args: argparse.Namespace) -> int:
    from mt_train.data.image_text import read_jsonl_records, write_image_text

    if args.image_shape is None or args.image_tokens is None:
        return report(
            "mt-prepare-data", "--image-text needs --image-shape C H W and --image-tokens N"
        )
    try:
        meta = write_image_text(
            args.out, read_jsonl_records(args.inputs), args.image_shape, args.image_tokens,
            args.val_every, args.max_tokens,
        )  # fmt: skip
    except (OSError, ValueError, UserError) as err:
        return report("mt-prepare-data", err)
    splits = meta["splits"]
    print(
        f"wrote {args.out}: "
        + ", ".join(f"{k} {v['samples']} samples / {v['images']} images" for k, v in splits.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
