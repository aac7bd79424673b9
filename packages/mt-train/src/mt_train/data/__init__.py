"""Tokenizers, data preparation, packed datasets and the resumable sampler."""

from mt_train.data import prepare
from mt_train.data.dataset import Batch, DataModule, PackedDataset, ResumableSampler
from mt_train.data.prepare import bundled_corpus, prepare_bundled, read_documents, write_prepared
from mt_train.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

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
