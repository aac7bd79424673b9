"""Start-up checks of a prepared data folder: every problem is one :class:`DataError` line.

``mt-train`` reads a folder written by ``mt-prepare-data`` (:mod:`mt_train.data.prepare`)
through memory maps, so a damaged folder would otherwise fail deep inside training (an
``IndexError`` in the embedding at step 1) or, worse, train on garbage silently. Before any
model is built, :func:`check_prepared` verifies:

* ``meta.json`` exists, is JSON, is an object with ``splits`` (``train`` and ``val``, each with
  integer ``tokens`` and ``documents``), a ``dtype`` in :data:`TOKEN_DTYPES`, a ``tokenizer``,
  ``eos_id`` and ``vocab_size``;
* for each split, ``<split>.bin`` holds exactly ``tokens`` ids of that dtype
  (``bytes = tokens · itemsize``: a truncated file, one longer than recorded or a wrong dtype
  all break it) and ``<split>.idx`` exactly ``documents + 1`` int64 offsets;
* each split has at least ``trainer.seq_len + 1`` tokens (one sequence and its last target);
* the tokenizer file exists and loads;
* the largest token id ``m``: ``meta.json``'s ``max_token_id`` (``mt-prepare-data`` records
  it), else computed from the token files; ``m < vocab_size`` of the tokenizer.

:func:`check_vocab` then holds the model to the data: ``model.vocab_size`` must cover the
tokenizer's ids (``≥ vocab_size``), and therefore every token id (``> m``): no id can reach
past the embedding. For an image-text folder (``"kind": "image_text"``) :func:`check_image_text`
holds a vision-language model to its ``image_token_id``, ``image_tokens`` and ``image_shape``
(``[model.vision.channels, model.vision.image_size, model.vision.image_size]``), which would
otherwise fail at the first batch or, for the token id, train with images never placed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mt_train.data.tokenizer import load_tokenizer
from mt_train.errors import DataError

TOKEN_DTYPES = ("uint16", "uint32")
SPLITS = ("train", "val")
PREPARE_HINT = "write the folder again with `mt-prepare-data`"


def _load_meta(folder: Path) -> dict[str, Any]:
    path = folder / "meta.json"
    if not folder.is_dir():
        raise DataError(f"data.path={str(folder)!r} is not a folder")
    if not path.is_file():
        raise DataError(f"{str(folder)!r} has no meta.json; {PREPARE_HINT}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not JSON ({err}); {PREPARE_HINT}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path} holds a JSON {type(meta).__name__}, not an object; {PREPARE_HINT}")
    missing = [k for k in ("splits", "dtype", "tokenizer", "eos_id", "vocab_size") if k not in meta]
    if missing:
        raise DataError(f"{path} lacks {missing}; {PREPARE_HINT}")
    if meta["dtype"] not in TOKEN_DTYPES:
        raise DataError(
            f"{path}: dtype {meta['dtype']!r} is not a token dtype; valid: {', '.join(TOKEN_DTYPES)}"
        )
    splits = meta["splits"]
    for split in SPLITS:
        info = splits.get(split) if isinstance(splits, dict) else None
        if not isinstance(info, dict) or not all(
            type(info.get(k)) is int and info[k] >= 0 for k in ("tokens", "documents")
        ):
            raise DataError(
                f"{path}: splits.{split} is {info!r}, not {{tokens, documents}} counts; "
                + PREPARE_HINT
            )
    for key in ("eos_id", "vocab_size"):
        if type(meta[key]) is not int or meta[key] < 0:
            raise DataError(f"{path}: {key} is {meta[key]!r}, not a non-negative integer")
    return meta


def _check_split(folder: Path, split: str, meta: dict[str, Any], seq_len: int) -> None:
    info, itemsize = meta["splits"][split], np.dtype(meta["dtype"]).itemsize
    tokens, docs = folder / f"{split}.bin", folder / f"{split}.idx"
    for path in (tokens, docs):
        if not path.is_file():
            raise DataError(f"{str(path)!r} is missing; {PREPARE_HINT}")
    size, expected = tokens.stat().st_size, info["tokens"] * itemsize
    if size != expected:
        raise DataError(
            f"{tokens} has {size} bytes; meta.json says {info['tokens']} tokens of "
            f"{meta['dtype']} = {expected} bytes (truncated, appended to, or another dtype); "
            + PREPARE_HINT
        )
    size, expected = docs.stat().st_size, (info["documents"] + 1) * 8
    if size != expected:
        raise DataError(
            f"{docs} has {size} bytes; meta.json says {info['documents']} documents = "
            f"{expected} bytes of int64 offsets; {PREPARE_HINT}"
        )
    if info["tokens"] < seq_len + 1:
        raise DataError(
            f"the {split} split of {folder} has {info['tokens']} tokens, fewer than one sequence "
            f"of trainer.seq_len={seq_len} + 1; use trainer.seq_len <= {max(info['tokens'] - 1, 0)} "
            "or more data"
        )


def max_token_id(folder: Path, meta: dict[str, Any], chunk: int = 1 << 24) -> int:
    """The largest token id in the folder's token files (``meta.json``'s ``max_token_id`` if
    recorded, else computed in chunks of ``chunk`` ids)."""
    recorded = meta.get("max_token_id")
    if type(recorded) is int:
        return recorded
    largest = -1
    for split in SPLITS:
        tokens = np.memmap(folder / f"{split}.bin", dtype=meta["dtype"], mode="r")
        for start in range(0, len(tokens), chunk):
            largest = max(largest, int(tokens[start : start + chunk].max()))
    return largest


def check_prepared(folder: str | Path, seq_len: int) -> dict[str, Any]:
    """Verify ``folder`` (module docstring); its ``meta.json`` with ``max_token_id`` set."""
    folder = Path(folder)
    meta = _load_meta(folder)
    for split in SPLITS:
        _check_split(folder, split, meta, seq_len)
    try:
        load_tokenizer(folder, meta["tokenizer"], meta.get("eos_token", "<|endoftext|>"))
    except (OSError, ValueError) as err:
        raise DataError(f"{folder}: the tokenizer cannot be loaded: {err}") from None
    largest = max_token_id(folder, meta)
    if largest >= meta["vocab_size"]:
        raise DataError(
            f"{folder} holds token id {largest}, outside its tokenizer's {meta['vocab_size']} ids "
            f"(meta.json vocab_size); {PREPARE_HINT}"
        )
    return {**meta, "max_token_id": largest}


def check_vocab(meta: dict[str, Any], vocab_size: int, folder: str | Path) -> None:
    """Raise unless a model of ``vocab_size`` embeddings covers the data's tokenizer (and so,
    by :func:`check_prepared`, every token id)."""
    if vocab_size < meta["vocab_size"]:
        raise DataError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer of {folder} "
            f"({meta['vocab_size']} ids); use model.vocab_size >= {meta['vocab_size']} or null"
        )


def check_image_text(meta: dict[str, Any], model: Any, folder: str | Path) -> None:
    """Raise unless ``model`` (the model config) reads the image-text folder ``folder``
    (module docstring); a text folder passes."""
    if meta.get("kind") != "image_text":
        return
    if not hasattr(model, "image_token_id"):
        raise DataError(
            f"{folder} holds image-text samples; train it with a vision-language model "
            "(model=vlm_tiny or model=llava_1_5_7b)"
        )
    vision = model.vision
    wanted = {
        "image_token_id": (meta["image_token_id"], model.image_token_id, "model.image_token_id"),
        "image_tokens": (meta["image_tokens"], model.image_tokens, "the model's image tokens"),
        "image_shape": (
            list(meta["image_shape"]),
            [vision.channels, vision.image_size, vision.image_size],
            "[model.vision.channels, model.vision.image_size, model.vision.image_size]",
        ),
    }
    for key, (data_value, model_value, name) in wanted.items():
        if data_value != model_value:
            raise DataError(
                f"{folder} was prepared with {key}={data_value}, but {name} is {model_value}; "
                f"set the model to match or prepare the folder again with `mt-prepare-data "
                f"--image-text`"
            )
