"""Tokenizers: raw UTF-8 bytes, or a Hugging Face ``tokenizers`` byte-level BPE.

Both map text to integer ids and back and know their end-of-document id, which the
packer puts after every document. The byte tokenizer needs no training and no files
(ids 0-255 are bytes, 256 is ``<|endoftext|>``), which is what the default run uses; a
BPE tokenizer is trained by :func:`train_bpe` or loaded from an existing ``tokenizer.json``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, ``<|endoftext|>`` as 256."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_piece(self, text: str) -> list[int]:
        """Ids of a piece of a sample (no special tokens: bytes have none)."""
        return self.encode(text)

    def sample_prefix(self) -> list[int]:
        """Special ids that open a sample: none."""
        return []

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def save(self, folder: Path) -> str:
        """Nothing to write; returns the name recorded in ``meta.json``."""
        return "byte"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (``tokenizer.json``) with a known end-of-document token."""

    kind = "hf"

    def __init__(self, tokenizer: object, eos_token: str = EOS_TOKEN) -> None:
        self.tokenizer = tokenizer
        eos_id = tokenizer.token_to_id(eos_token)  # type: ignore[attr-defined]
        if eos_id is None:
            raise ValueError(
                f"the tokenizer has no end-of-document token {eos_token!r}; pass the name of one "
                "it has (e.g. '<|end_of_text|>' for Llama 3)"
            )
        self.eos_token = eos_token
        self.eos_id = int(eos_id)
        self.vocab_size = int(tokenizer.get_vocab_size())  # type: ignore[attr-defined]

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str = EOS_TOKEN) -> HFTokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        try:
            loaded = Tokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises plain Exception
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(
                f"{str(path)!r} is not a Hugging Face tokenizer.json ({message})"
            ) from None
        return cls(loaded, eos_token)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)  # type: ignore[attr-defined]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of ``texts``; ``encode_batch_fast`` skips the character offsets (the same ids,
        faster than ``encode_batch``: docs/performance.md, data preparation)."""
        encoded = self.tokenizer.encode_batch_fast(list(texts))  # type: ignore[attr-defined]
        return [e.ids for e in encoded]

    def encode_piece(self, text: str) -> list[int]:
        """Ids of a piece of a sample (the text between two ``<image>``), without the special
        tokens the tokenizer's post-processor adds to a whole text (a BOS would otherwise
        open every piece)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    def sample_prefix(self) -> list[int]:
        """The special ids the post-processor puts before a text (Llama's BOS), which open an
        image-text sample once."""
        plain = self.encode_piece("a")
        full = self.encode("a")
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start]
        return []

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))  # type: ignore[attr-defined]

    def save(self, folder: Path) -> str:
        self.tokenizer.save(str(folder / "tokenizer.json"))  # type: ignore[attr-defined]
        return "tokenizer.json"


Tokenizer = ByteTokenizer | HFTokenizer


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ValueError(
            f"BPE vocab_size must be at least 300 (256 bytes + merges), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok)


def load_tokenizer(folder: str | Path, name: str, eos_token: str = EOS_TOKEN) -> Tokenizer:
    """The tokenizer recorded in a prepared folder's ``meta.json`` (``byte`` or a file name)."""
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer.from_file(Path(folder) / name, eos_token)
