"""Tokenizers, data preparation, packed datasets and the resumable sampler.

The exports load on first use (PEP 562 ``__getattr__``, as in :mod:`mt_train`): the
datasets import torch, which data preparation does not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mt_train.data import prepare
    from mt_train.data.dataset import Batch, DataModule, PackedDataset, ResumableSampler
    from mt_train.data.prepare import (
        bundled_corpus,
        prepare_bundled,
        read_documents,
        write_prepared,
    )
    from mt_train.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

_EXPORTS = {
    "Batch": "mt_train.data.dataset",
    "ByteTokenizer": "mt_train.data.tokenizer",
    "DataModule": "mt_train.data.dataset",
    "HFTokenizer": "mt_train.data.tokenizer",
    "PackedDataset": "mt_train.data.dataset",
    "ResumableSampler": "mt_train.data.dataset",
    "bundled_corpus": "mt_train.data.prepare",
    "load_tokenizer": "mt_train.data.tokenizer",
    "prepare_bundled": "mt_train.data.prepare",
    "read_documents": "mt_train.data.prepare",
    "train_bpe": "mt_train.data.tokenizer",
    "write_prepared": "mt_train.data.prepare",
}

__all__ = [
    "Batch",
    "ByteTokenizer",
    "DataModule",
    "HFTokenizer",
    "PackedDataset",
    "ResumableSampler",
    "bundled_corpus",
    "load_tokenizer",
    "prepare",
    "prepare_bundled",
    "read_documents",
    "train_bpe",
    "write_prepared",
]


def __getattr__(name: str) -> Any:
    if name == "prepare":
        return importlib.import_module("mt_train.data.prepare")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mt_train.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
