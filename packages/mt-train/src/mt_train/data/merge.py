"""``mt-prepare-data merge OUT IN...``: one prepared folder from several with one tokenizer.

Split by split, the token files are concatenated in the order given and each input's
document offsets are shifted by the tokens before it (``idx_out = idx_k + Σ_{j<k} tokens_j``,
the leading zero of every input after the first dropped), so document ``d`` of input ``k`` is
document ``Σ_{j<k} documents_j + d`` of the result and every document keeps its split.
Files are copied in chunks of ``CHUNK`` bytes (memory does not grow with the data), and the
folder is published atomically (:mod:`mt_train.data.publish`). Inputs are checked first
(:func:`mt_train.data.checks.check_prepared`); different tokenizers are refused in one line
naming both folders (:func:`mt_train.data.blend.check_same_tokenizer`).
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mt_train.data.blend import check_same_tokenizer
from mt_train.data.checks import SPLITS, check_prepared
from mt_train.data.publish import building, write_meta
from mt_train.data.tokenizer import load_tokenizer
from mt_train.errors import UserError, report

CHUNK = 1 << 24
"""Bytes (or offsets, for ``.idx`` files) copied at a time."""


def _append_offsets(source: Path, target: Any, shift: int, first: bool) -> None:
    offsets = np.memmap(source, dtype=np.int64, mode="r")
    for start in range(0 if first else 1, len(offsets), CHUNK):
        (np.asarray(offsets[start : start + CHUNK]) + shift).tofile(target)


def merge_prepared(out: Path, inputs: Sequence[Path]) -> dict[str, Any]:
    """Concatenate the prepared folders ``inputs`` into ``out`` (module docstring)."""
    if len(inputs) < 2:
        raise UserError(f"merge needs at least two input folders, got {len(inputs)}")
    metas = [check_prepared(folder, 0) for folder in inputs]
    check_same_tokenizer(list(inputs), metas)
    first = metas[0]
    with building(Path(out)) as partial:
        splits: dict[str, dict[str, int]] = {}
        for split in SPLITS:
            tokens = documents = 0
            with (
                open(partial / f"{split}.bin", "wb") as bin_out,
                open(partial / f"{split}.idx", "wb") as idx_out,
            ):
                for k, (folder, meta) in enumerate(zip(inputs, metas, strict=True)):
                    with open(Path(folder) / f"{split}.bin", "rb") as bin_in:
                        shutil.copyfileobj(bin_in, bin_out, CHUNK)
                    _append_offsets(Path(folder) / f"{split}.idx", idx_out, tokens, k == 0)
                    tokens += meta["splits"][split]["tokens"]
                    documents += meta["splits"][split]["documents"]
            splits[split] = {"tokens": tokens, "documents": documents}
        tokenizer = load_tokenizer(inputs[0], first["tokenizer"], first.get("eos_token", ""))
        meta = {
            **{k: first[k] for k in ("format", "eos_token", "eos_id", "vocab_size", "dtype")},
            "tokenizer": tokenizer.save(partial),
            "max_token_id": max(m["max_token_id"] for m in metas),
            "splits": splits,
            "skipped_records": sum(int(m.get("skipped_records", 0)) for m in metas),
            "merged_from": [str(Path(f).resolve()) for f in inputs],
        }
        write_meta(partial, meta)
    return meta


def merge_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mt-prepare-data merge",
        description="Concatenate prepared data folders that share a tokenizer.",
    )
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("inputs", nargs="+", type=Path, help="prepared folders, in order")
    args = parser.parse_args(argv)
    try:
        meta = merge_prepared(args.out, args.inputs)
    except (OSError, ValueError, UserError) as err:
        return report("mt-prepare-data", err)
    splits = meta["splits"]
    print(
        f"merged {len(args.inputs)} folders into {args.out}: "
        + ", ".join(
            f"{k} {v['tokens']:,} tokens / {v['documents']} docs" for k, v in splits.items()
        )
    )
    return 0
