"""Image-text data: ``mt-prepare-data --image-text`` and the dataset the trainer reads.

Input: JSONL, one sample a line, ``{"image": I, "text": "..."}`` or ``{"images": [I, ...],
"prompt": "...", "text": "..."}``; an image ``I`` is a path to a ``.npy`` array (relative to
the JSONL file) or a nested list; arrays are ``H×W`` (grey) or ``C×H×W``, integers in
``[0, 255]``. ``<image>`` marks where each image goes, in order; placeholders and images must
match one to one. ``prompt`` (optional) carries no loss; ``text`` (the caption or answer) and
the closing EOS do.

Tokens. Byte tokens by default, with one extra id for image tokens, ``image_token_id = 257``
(``vocab_size`` 258). With a Hugging Face ``tokenizer.json`` (``--tokenizer``, a Llama
tokenizer for ``llava_1_5_7b``), a vocabulary that already holds ``<image>`` as a token (as
llava-hf's adds it, id 32000) keeps that id and its size; otherwise the image id is appended
(``image_token_id`` = the tokenizer's vocabulary size, ``vocab_size`` one more). Text around
each ``<image>`` is tokenized piece by piece without special tokens, so a placeholder never
merges with its neighbours; the ids the tokenizer's post-processor puts before a text (Llama's
BOS) open the sample once, untrained. ``model.image_token_id`` must equal the folder's (checked when training starts).

Output folder, written into ``.<name>.partial-<host>-<pid>`` and renamed into place when complete
(:func:`mt_train.data.publish.building`)::

    meta.json              {"format": 1, "kind": "image_text", "tokenizer": "byte" |
                            "tokenizer.json", "eos_token", "eos_id", "vocab_size",
                            "image_token_id", "image_tokens" (L),
                            "image_shape": [C, H, W], "pixel_mean", "pixel_std" (per
                            channel, of the train split's pixels / 255), "dtype": "uint16"
                            (or "uint32" past 65,536 ids),
                            "max_token_id", "splits": {"train": {"samples", "images",
                            "tokens", "documents" (= samples)}, "val": ...}}
    <split>.bin / .idx     every sample's ids (each ``<image>`` expanded to L image tokens,
                           then EOS) concatenated; int64 sample offsets (samples + 1)
    <split>.mask           uint8 per token: 1 where the token is a trained target
    <split>.images         uint8 images ``(N, C, H, W)`` (memory-mapped)
    <split>.image_idx      int64 image offsets per sample (samples + 1)
    <split>.source         int64 JSONL line of each sample (for error messages)
    tokenizer.json         the Hugging Face tokenizer (absent for byte tokens)

Record ``r`` goes to validation when ``r % val_every == val_every - 1``.

Samples (:class:`ImageTextDataset`): sample ``i`` with ids ``t_0..t_n`` (``n + 1 ≤ T + 1``)
gives inputs ``t_0..t_{n-1}`` padded with EOS to ``T`` and targets ``t_1..t_n`` where the
mask is 1, else ``IGNORE_INDEX`` (image tokens, prompt, padding); its images follow in the
batch's ``images`` in sample order, normalised per channel as CLIP's processor does with its
data's statistics: ``(x/255 − pixel_mean) / pixel_std`` (float32). Sample indices come from the
same :class:`~mt_train.data.dataset.ResumableSampler` as text windows.

Packing (``data.pack_samples``, ``pack=True``). The split's samples are cut into packs whose
inputs fit one sequence, and the sampler draws packs, not samples. A pack is a list of sample
ids (CSR: pack ``p`` holds ``pack_members[pack_offsets[p] : pack_offsets[p+1]]``); with
``n_i = |ids_i| − 1`` the inputs of sample ``i``, every sample is in exactly one pack and
every pack's ``Σ n_i ≤ T``. ``data.pack_order`` (``order``) says how packs are formed:

- ``consecutive`` (default): in file order, greedily, sample ``i`` joins the open pack while
  the inputs total at most ``T``, else opens the next (each pack a run of consecutive samples).
- ``shuffled``: the same greedy cut over the split's samples permuted by
  ``numpy.random.default_rng([seed, PACK_SHUFFLE_STREAM]).permutation(N)`` with ``seed`` the
  run's data seed (``trainer.seed``, the sampler's); a pack keeps the permuted order, so
  packs mix samples from across the file. The sampler's epoch streams are ``[seed, e]``; no
  epoch reaches :data:`PACK_SHUFFLE_STREAM`, so the two never share a stream.
- ``best_fit``: Best-Fit-Decreasing bin packing. Samples are taken longest first (equal
  lengths by sample id); each joins the open pack with the least room ``T − Σ n`` that still
  fits it (equal rooms: the pack opened first), else opens a new pack. Packs are numbered in
  the order they open and hold their samples in file order. The rows' inputs total ``Σ n_i``
  however samples are packed, so fewer packs mean less padding: consecutive packing is
  next-fit in file order, which can need nearly twice the fewest possible packs (inputs
  ``T/2, 1, T/2, 1, …``: every row half empty), while best-fit-decreasing needs at most 11/9
  of the fewest possible packs plus 4 (Johnson, 1973).

Packing reads only the samples' lengths (and the seed), so it is the same in every run and on
every rank and a resumed run draws the same packs. :attr:`ImageTextDataset.padding_fraction`
is the share of the rows' ``rows · T`` input tokens that are padding (the trainer's banner
prints it). A pack's row holds its samples' inputs and
targets one after another (each as above), then EOS padding with ``IGNORE_INDEX`` targets; its
document ids are ``k`` on the ``k``-th sample's tokens and the sample count on the padding, so
attention stays inside each sample (:mod:`mt_parallel.document_attention`) and the VLM restarts
RoPE positions at each sample (:meth:`~mt_train.models.vlm.VisionLanguageModel.sequence_inputs`).
The images follow in row order and, within a row, in the pack's sample order: the order of the
placeholders, which is what :class:`~mt_train.models.vlm.model.ImagePlacement` fills, however
many images each row has. :meth:`ImageTextDataset.target_counts` sums the pack's samples, so the
token-weighted loss (:mod:`mt_train.loss_weights`) counts every trained target once.

Fixed image count (``pad_images=True``, which ``trainer.cuda_graph`` sets: a captured step
replays fixed shapes). With ``M`` the most images any row (pack or sample) of the split holds,
a batch of ``B`` rows carries exactly ``B·M`` images: its own, in the order above, then zero
images. No placeholder numbers the padding (the ``k``-th placeholder run takes image ``k``,
and the batch has fewer runs than ``B·M``), so the padding never reaches the decoder and
gets no gradient; its cost is the encoder's compute on ``B·M`` images instead of the batch's
own (:attr:`ImageTextDataset.row_images` says ``M``).

Bad input (a missing or unreadable image, a wrong shape or channel count, placeholders not
matching images, a sample longer than the sequence) raises one line naming the file and line.
"""

from __future__ import annotations

import bisect
import heapq
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mt_train.data.dataset import Batch
from mt_train.data.publish import building, write_meta
from mt_train.data.tokenizer import EOS_TOKEN, ByteTokenizer, Tokenizer

FORMAT_VERSION = 1
KIND = "image_text"
IMAGE_PLACEHOLDER = "<image>"
MIN_PIXEL_STD = 1e-3
"""Floor of a channel's normalising std (a constant channel would divide by zero)."""
IGNORE_INDEX = -100
"""Targets that carry no loss (matches :data:`mt_train.models.vlm.IGNORE_INDEX`)."""
PACK_ORDERS = ("consecutive", "shuffled", "best_fit")
"""How packs are formed (``data.pack_order``; module docstring)."""
PACK_SHUFFLE_STREAM = 0x7061636B
"""Second seed word of the ``shuffled`` order's permutation (ASCII ``pack``; module docstring)."""


class ImageTextError(ValueError):
    """A sample that cannot be used; the message names it."""


def _image_array(value: Any, where: str, base: Path) -> np.ndarray:
    if isinstance(value, str):
        path = (base / value) if not Path(value).is_absolute() else Path(value)
        if not path.is_file():
            raise ImageTextError(f"{where}: image file {str(path)!r} does not exist")
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ImageTextError(
                f"{where}: image file {str(path)!r} is not a readable .npy array ({err})"
            ) from err
    try:
        return np.asarray(value)
    except ValueError as err:
        raise ImageTextError(f"{where}: the image is not a rectangular array ({err})") from err


def load_image(value: Any, where: str, base: Path, shape: Sequence[int]) -> np.ndarray:
    """One image as uint8 ``(C, H, W)``; raises naming ``where`` unless it has ``shape``."""
    array = _image_array(value, where, base)
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3 or tuple(array.shape) != tuple(shape):
        raise ImageTextError(
            f"{where}: image of shape {tuple(array.shape)}, expected {tuple(shape)} "
            "(channels x height x width; a 2-D array is one channel)"
        )
    if not np.issubdtype(array.dtype, np.number) or (
        array.size and (array.min() < 0 or array.max() > 255)
    ):
        raise ImageTextError(f"{where}: image values must be numbers in [0, 255]")
    return np.rint(array).astype(np.uint8)


def encode_sample(
    record: dict[str, Any], where: str, base: Path, shape: Sequence[int], image_tokens: int,
    tokenizer: Tokenizer, image_token_id: int, max_tokens: int | None,
    dtype: type = np.uint16,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:  # fmt: skip
    """``(ids, mask, images)`` of one JSONL record (module docstring)."""
    if "text" not in record:
        raise ImageTextError(f"{where}: no field 'text' (fields: {sorted(record)})")
    values = record.get("images", [record["image"]] if "image" in record else [])
    if not isinstance(values, list):
        raise ImageTextError(f"{where}: 'images' must be a list")
    images = [load_image(v, f"{where} image {k}", base, shape) for k, v in enumerate(values)]
    ids: list[int] = tokenizer.sample_prefix()
    mask: list[int] = [0] * len(ids)
    placeholders = 0
    for part, trained in ((str(record.get("prompt", "")), 0), (str(record["text"]), 1)):
        for k, piece in enumerate(part.split(IMAGE_PLACEHOLDER)):
            if k:
                placeholders += 1
                ids += [image_token_id] * image_tokens
                mask += [0] * image_tokens
            encoded = tokenizer.encode_piece(piece)
            ids += encoded
            mask += [trained] * len(encoded)
    if placeholders != len(images):
        raise ImageTextError(
            f"{where}: {placeholders} {IMAGE_PLACEHOLDER} placeholders for {len(images)} images "
            "(each image needs one placeholder, in order)"
        )
    ids.append(tokenizer.eos_id)
    mask.append(1)
    if max_tokens is not None and len(ids) > max_tokens:
        raise ImageTextError(
            f"{where}: {len(ids)} tokens after expanding {len(images)} images to "
            f"{image_tokens} tokens each, more than the {max_tokens} allowed"
        )
    return np.asarray(ids, dtype), np.asarray(mask, np.uint8), images


def image_token_of(tokenizer: Tokenizer) -> tuple[int, int]:
    """``(image_token_id, vocab_size)`` for ``tokenizer`` (module docstring, Tokens)."""
    existing = getattr(tokenizer, "tokenizer", None)
    found = existing.token_to_id(IMAGE_PLACEHOLDER) if existing is not None else None
    if found is not None:
        return int(found), tokenizer.vocab_size
    return tokenizer.vocab_size, tokenizer.vocab_size + 1


def write_image_text(
    out: Path,
    records: Iterable[tuple[str, Path, dict[str, Any]]],
    image_shape: Sequence[int],
    image_tokens: int,
    val_every: int,
    max_tokens: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """Write the folder of the module docstring from ``(where, base folder, record)``
    triples; ``where`` names the record in errors (``file:line``); byte tokens unless a
    ``tokenizer`` is given. ``out`` is replaced only when complete (module docstring)."""
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every}")
    tokenizer = tokenizer or ByteTokenizer()
    image_token_id, vocab_size = image_token_of(tokenizer)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    splits: dict[str, dict[str, list]] = {
        s: {"ids": [], "mask": [], "images": [], "counts": [], "source": []}
        for s in ("train", "val")
    }
    for r, (where, base, record) in enumerate(records):
        ids, mask, images = encode_sample(
            record, where, base, image_shape, image_tokens, tokenizer, image_token_id, max_tokens,
            dtype,
        )  # fmt: skip
        split = splits["val" if r % val_every == val_every - 1 else "train"]
        split["ids"].append(ids)
        split["mask"].append(mask)
        split["images"] += images
        split["counts"].append(len(images))
        split["source"].append(int(where.rsplit(":", 1)[-1]) if ":" in where else r)
    train_pixels = np.stack(splits["train"]["images"]).astype(np.float64) / 255.0
    channel_axes = (0, 2, 3)
    pixel_std = np.maximum(train_pixels.std(axis=channel_axes), MIN_PIXEL_STD)
    meta: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "kind": KIND,
        "tokenizer": "byte",
        "eos_token": getattr(tokenizer, "eos_token", EOS_TOKEN),
        "eos_id": tokenizer.eos_id,
        "vocab_size": vocab_size,
        "image_token_id": image_token_id,
        "image_tokens": image_tokens,
        "image_shape": list(image_shape),
        "pixel_mean": train_pixels.mean(axis=channel_axes).tolist(),
        "pixel_std": pixel_std.tolist(),
        "dtype": np.dtype(dtype).name,
        "splits": {},
    }
    for name, split in splits.items():
        if not split["ids"]:
            raise ValueError(f"the {name} split is empty (val_every={val_every})")
    with building(out) as folder:
        meta["tokenizer"] = tokenizer.save(folder)
        max_id = 0
        for name, split in splits.items():
            lengths = [len(a) for a in split["ids"]]
            ids = np.concatenate(split["ids"])
            max_id = max(max_id, int(ids.max()))
            ids.tofile(folder / f"{name}.bin")
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            offsets.tofile(folder / f"{name}.idx")
            np.concatenate(split["mask"]).tofile(folder / f"{name}.mask")
            images = np.stack(split["images"]) if split["images"] else np.zeros((0, *image_shape))
            images.astype(np.uint8).tofile(folder / f"{name}.images")
            starts = np.concatenate([[0], np.cumsum(split["counts"])]).astype(np.int64)
            starts.tofile(folder / f"{name}.image_idx")
            np.asarray(split["source"], np.int64).tofile(folder / f"{name}.source")
            meta["splits"][name] = {
                "samples": len(lengths), "images": len(split["images"]),
                "tokens": int(sum(lengths)), "documents": len(lengths),
            }  # fmt: skip
        meta["max_token_id"] = max_id
        write_meta(folder, meta)
    return meta


def read_jsonl_records(paths: Sequence[Path]) -> Iterable[tuple[str, Path, dict[str, Any]]]:
    """``(file:line, the file's folder, record)`` for every non-empty line."""
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input file {str(path)!r} does not exist")
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ImageTextError(f"{path}:{lineno}: not a JSON object ({err})") from err
            if not isinstance(record, dict):
                raise ImageTextError(f"{path}:{lineno}: not a JSON object")
            yield f"{path}:{lineno}", path.parent, record


class ImageTextDataset:
    """One split of an image-text folder as fixed-length samples (module docstring)."""

    def __init__(
        self,
        folder: str | Path,
        split: str,
        seq_len: int,
        pack: bool = False,
        pad_images: bool = False,
        pack_order: str = "consecutive",
        pack_seed: int = 0,
    ) -> None:
        if pack_order not in PACK_ORDERS:
            raise ValueError(
                f"data.pack_order={pack_order!r} is unknown; valid: {', '.join(PACK_ORDERS)}"
            )
        if pack_order != "consecutive" and not pack:
            raise ValueError(
                f"data.pack_order={pack_order} orders packed samples; set data.pack_samples=true"
            )
        folder = Path(folder)
        self.meta = json.loads((folder / "meta.json").read_text())
        if split not in self.meta["splits"]:
            raise ValueError(
                f"split {split!r} not in {folder}; splits: {list(self.meta['splits'])}"
            )
        self.tokens = np.memmap(folder / f"{split}.bin", dtype=self.meta["dtype"], mode="r")
        self.mask = np.memmap(folder / f"{split}.mask", dtype=np.uint8, mode="r")
        self.starts = np.fromfile(folder / f"{split}.idx", dtype=np.int64)
        self.image_starts = np.fromfile(folder / f"{split}.image_idx", dtype=np.int64)
        shape = tuple(self.meta["image_shape"])
        n_images = int(self.image_starts[-1])
        self.images = (
            np.memmap(
                folder / f"{split}.images", dtype=np.uint8, mode="r", shape=(n_images, *shape)
            )
            if n_images
            else np.zeros((0, *shape), np.uint8)
        )
        self.pixel_mean = torch.tensor(self.meta["pixel_mean"]).view(-1, 1, 1)
        self.pixel_std = torch.tensor(self.meta["pixel_std"]).view(-1, 1, 1)
        self.source = np.fromfile(folder / f"{split}.source", dtype=np.int64)
        self.seq_len, self.eos_id = seq_len, int(self.meta["eos_id"])
        lengths = np.diff(self.starts)
        too_long = np.flatnonzero(lengths > seq_len + 1)
        if too_long.size:
            i = int(too_long[0])
            raise ImageTextError(
                f"{folder} {split} sample {i} (input line {self.source[i]}) has {lengths[i]} "
                f"tokens, more than trainer.seq_len + 1 = {seq_len + 1} "
                f"({too_long.size} samples are too long)"
            )
        self.pack_order = pack_order if pack else None
        """``data.pack_order`` of a packed split, None unpacked."""
        self.pack_offsets: np.ndarray | None = None
        """Pack ``p`` holds samples ``pack_members[pack_offsets[p] : pack_offsets[p+1]]``."""
        self.pack_members = np.arange(len(lengths), dtype=np.int64)
        """Sample ids, pack after pack (module docstring); every sample once."""
        if pack:
            self.pack_offsets, self.pack_members = build_packs(
                lengths - 1, seq_len, pack_order, pack_seed
            )
        rows = len(self)
        row_offsets = self.pack_offsets if pack else np.arange(rows + 1)
        row_image_counts = np.add.reduceat(
            np.diff(self.image_starts)[self.pack_members], row_offsets[:-1]
        )
        self.row_images = int(row_image_counts.max(initial=0))
        """The most images a row (pack or sample) of this split holds."""
        self.padding_fraction = 1.0 - float((lengths - 1).sum()) / (rows * seq_len)
        """The share of the rows' input tokens that are padding (module docstring)."""
        self.pad_images = pad_images
        """Pad every batch to ``rows · row_images`` images (module docstring)."""

    def __len__(self) -> int:
        if self.pack_offsets is not None:
            return len(self.pack_offsets) - 1
        return len(self.starts) - 1

    def row_samples(self, index: int) -> np.ndarray:
        """The samples of sampler item ``index``, in row order: its pack's samples, or the
        sample itself."""
        if self.pack_offsets is None:
            return np.arange(index, index + 1)
        return self.pack_members[self.pack_offsets[index] : self.pack_offsets[index + 1]]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample ``i``'s token ids, trained-target mask and uint8 images."""
        a, b = self.starts[i], self.starts[i + 1]
        images = self.images[self.image_starts[i] : self.image_starts[i + 1]]
        return np.asarray(self.tokens[a:b], np.int64), np.asarray(self.mask[a:b]), images

    def target_counts(self, indices: np.ndarray) -> np.ndarray:
        """The trained (unmasked) targets of each row of ``indices`` (packs or samples), as
        :meth:`collate` makes them, read from the masks alone."""
        return np.array(
            [
                sum(
                    int(np.count_nonzero(self.mask[self.starts[j] + 1 : self.starts[j + 1]]))
                    for j in self.row_samples(int(i)).tolist()
                )
                for i in indices
            ],
            dtype=np.int64,
        )

    def collate(self, indices: np.ndarray, documents: bool = False) -> Batch:
        """Rows ``indices`` (packs or samples) as a batch with their images; packed rows carry
        document ids (module docstring), unpacked ones none (one sample per row, whatever
        ``documents`` asks)."""
        T = self.seq_len
        inputs = np.full((len(indices), T), self.eos_id, np.int64)
        targets = np.full((len(indices), T), IGNORE_INDEX, np.int64)
        docs = np.zeros((len(indices), T), np.int64)
        images = []
        for row, index in enumerate(indices):
            offset = 0
            samples = self.row_samples(int(index)).tolist()
            for k, i in enumerate(samples):
                ids, mask, imgs = self.sample(i)
                end = offset + len(ids) - 1
                inputs[row, offset:end] = ids[:-1]
                targets[row, offset:end] = np.where(mask[1:] == 1, ids[1:], IGNORE_INDEX)
                docs[row, offset:end] = k
                images.append(np.asarray(imgs))
                offset = end
            docs[row, offset:] = len(samples)
        pixels = self.normalize(np.concatenate(images))
        if self.pad_images:
            padding = len(indices) * self.row_images - pixels.shape[0]
            pixels = torch.cat([pixels, pixels.new_zeros(padding, *pixels.shape[1:])])
        document_ids = None if self.pack_offsets is None else torch.from_numpy(docs)
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets), document_ids, pixels)

    def normalize(self, images_NCHW: np.ndarray) -> torch.Tensor:
        """uint8 images as the model's float32 input (module docstring)."""
        pixels = torch.from_numpy(np.array(images_NCHW, dtype=np.float32)) / 255.0
        return (pixels - self.pixel_mean) / self.pixel_std


def build_packs(
    input_lengths: np.ndarray, seq_len: int, order: str = "consecutive", seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, samples)``: pack ``p`` holds samples ``samples[offsets[p] : offsets[p+1]]``,
    packed in ``order`` (:data:`PACK_ORDERS`; ``seed`` for ``shuffled``) so that each pack's
    ``input_lengths`` total at most ``seq_len`` (module docstring)."""
    if order not in PACK_ORDERS:
        raise ValueError(f"pack order {order!r} is unknown; valid: {', '.join(PACK_ORDERS)}")
    lengths = np.asarray(input_lengths, dtype=np.int64)
    too_long = np.flatnonzero(lengths > seq_len)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"sample {i} has {lengths[i]} inputs, more than a pack's {seq_len}")
    if order == "best_fit":
        return best_fit_packs(lengths, seq_len)
    if order == "shuffled":
        samples = np.random.default_rng([seed, PACK_SHUFFLE_STREAM]).permutation(len(lengths))
    else:
        samples = np.arange(len(lengths), dtype=np.int64)
    return pack_boundaries(lengths[samples], seq_len), samples.astype(np.int64)


def pack_boundaries(input_lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """The first position of each greedy pack of consecutive ``input_lengths`` totalling at
    most ``seq_len``, then the count: the ``consecutive`` packs' offsets (module docstring)."""
    starts = [0]
    filled = 0
    for i, length in enumerate(input_lengths.tolist()):
        if filled + length > seq_len:
            starts.append(i)
            filled = 0
        filled += length
    starts.append(len(input_lengths))
    return np.asarray(starts, np.int64)


def best_fit_packs(input_lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-Fit-Decreasing packs of ``input_lengths`` (each at most ``seq_len``) as
    :func:`build_packs` returns them (module docstring)."""
    lengths = input_lengths.tolist()
    members: list[list[int]] = []
    # Open packs by room: the sorted distinct rooms, and each room's packs as a min-heap of
    # pack numbers, so the best fit is one bisection and ties go to the pack opened first.
    rooms: list[int] = []
    packs_with_room: dict[int, list[int]] = {}
    for i in np.argsort(-np.asarray(lengths, np.int64), kind="stable").tolist():
        length = lengths[i]
        k = bisect.bisect_left(rooms, length)
        if k < len(rooms):
            room = rooms[k]
            pack = heapq.heappop(packs_with_room[room])
            if not packs_with_room[room]:
                del packs_with_room[room]
                rooms.pop(k)
            room -= length
        else:
            pack, room = len(members), seq_len - length
            members.append([])
        members[pack].append(i)
        if room not in packs_with_room:
            packs_with_room[room] = []
            bisect.insort(rooms, room)
        heapq.heappush(packs_with_room[room], pack)
    offsets = np.cumsum([0] + [len(m) for m in members], dtype=np.int64)
    samples = np.asarray([i for m in members for i in sorted(m)], np.int64)
    return offsets, samples
