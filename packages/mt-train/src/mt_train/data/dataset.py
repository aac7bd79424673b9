"""Packed sequences from a prepared folder and the deterministic, resumable, DP-aware sampler.

Packing. A split is one stream of ``N`` tokens (documents each followed by EOS). With stride
``R`` (``T`` by default), sample ``i`` (``0 ≤ i < S = (N-1-T) // R + 1``) is the window
``tokens[i·R : i·R+T+1]``: inputs are its first ``T`` tokens, targets its last ``T``. With
``R = T`` windows do not overlap (``S = (N-1) // T``), so an epoch reads every token once;
``R = 1`` makes every token a window start (``data.sampling=random``). Documents stay visible
as boundaries: each ends with EOS, and the split's document offsets (``<split>.idx``) are
loaded as ``doc_starts``.

Document ids (``collate(..., documents=True)``). Input token ``j`` of sample ``i`` sits at
stream position ``p = i·R + j`` and belongs to document ``k`` with
``doc_starts[k] ≤ p < doc_starts[k+1]`` (an EOS belongs to the document it ends, so the EOS
input, whose target is the next document's first token, still attends to its own document,
Megatron's ``reset_attention_mask`` rule). Ids are renumbered from 0 in each row; only
equality matters to the attention mask.

Sampling. The sampler's whole state is ``consumed``, the number of samples drawn over all
ranks. Global draw ``g`` is sample ``perm_e[g mod S]`` with ``e = g div S`` and
``perm_e`` the permutation of ``range(S)`` from ``numpy.random.default_rng([seed, e])``
(``data.sampling=permutation``), or, with independent draws (``data.sampling=random``),
sample ``h(seed, g) mod S`` for the 64-bit SplitMix64 hash ``h`` (a bias below ``S / 2⁶⁴``),
so no permutation of all samples is ever built.
Step ``s`` draws ``g ∈ [s·G, (s+1)·G)`` (``G`` the global batch); data-parallel rank
``r`` of ``dp`` takes, for micro-batch ``m`` of ``A = G / (b·dp)``, the draws
``s·G + (m·dp + r)·b + j`` for ``j < b``. Every layout with the same ``G`` therefore
trains on the same samples each step, and a checkpoint stores only ``consumed``, which
makes resuming exact and lets a run resume at another dp.

Skipping (rewind). ``skipped`` is a sorted list of disjoint draw ranges ``[a, b)`` that are
never trained on: before drawing a step, a ``consumed`` that falls inside one jumps to its
end. Rewind adds the ranges it decides to skip (the window between a checkpoint and an
anomaly, or only the anomalous step's draws) and sets ``consumed`` back to the checkpoint's,
so a checkpoint's data state is ``consumed`` plus ``skipped`` (omitted while empty).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mt_train.data.tokenizer import Tokenizer, load_tokenizer


@dataclass
class Batch:
    """One micro-batch: inputs, targets and (optionally) document ids, all (B, T) int64; for
    image-text data also the images ``(N, C, H, W)`` float32 in [0, 1], in sample order."""

    inputs: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor | None = None
    images: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        docs, images = self.document_ids, self.images
        return Batch(
            self.inputs.to(device, non_blocking=True),
            self.targets.to(device, non_blocking=True),
            None if docs is None else docs.to(device, non_blocking=True),
            None if images is None else images.to(device, non_blocking=True),
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword inputs of the model beyond the tokens (the images, when there are any)."""
        return {} if self.images is None else {"images": self.images}


class PackedDataset:
    """Fixed-length windows over one split of a prepared folder (memory-mapped)."""

    def __init__(
        self, folder: str | Path, split: str, seq_len: int, stride: int | None = None
    ) -> None:
        folder = Path(folder)
        meta_path = folder / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{str(folder)!r} has no meta.json; write the folder with `mt-prepare-data`"
            )
        self.meta = json.loads(meta_path.read_text())
        if split not in self.meta["splits"]:
            raise ValueError(
                f"split {split!r} not in {folder}; splits: {list(self.meta['splits'])}"
            )
        self.tokens = np.memmap(folder / f"{split}.bin", dtype=self.meta["dtype"], mode="r")
        self.doc_starts = np.fromfile(folder / f"{split}.idx", dtype=np.int64)[:-1]
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.num_samples = max(0, (len(self.tokens) - 1 - seq_len) // self.stride + 1)
        if len(self.tokens) < seq_len + 1:
            raise ValueError(
                f"the {split} split of {folder} has {len(self.tokens)} tokens, fewer than one "
                f"sequence of trainer.seq_len={seq_len} + 1"
            )

    def __len__(self) -> int:
        return self.num_samples

    def collate(self, indices: np.ndarray, documents: bool = False) -> Batch:
        """Samples ``indices`` as a batch; ``documents``: with per-token document ids."""
        T, R = self.seq_len, self.stride
        rows = np.stack(
            [np.asarray(self.tokens[i * R : i * R + T + 1], dtype=np.int64) for i in indices]
        )
        window = torch.from_numpy(rows)
        docs = None
        if documents:
            positions = np.asarray(indices, dtype=np.int64)[:, None] * R + np.arange(T)
            ids = np.searchsorted(self.doc_starts, positions, side="right") - 1
            docs = torch.from_numpy(ids - ids[:, :1])
        return Batch(window[:, :-1].contiguous(), window[:, 1:].contiguous(), docs)


def splitmix64(seed: int, draws: np.ndarray) -> np.ndarray:
    """SplitMix64 of ``seed·2³² + g`` for every draw ``g`` (uint64; Steele et al. 2014): a fixed
    function of the seed and the draw number, whatever the rank, layout or resume point."""
    with np.errstate(over="ignore"):
        z = np.asarray(draws, dtype=np.uint64) + np.uint64((seed << 32) & (2**64 - 1))
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class ResumableSampler:
    """Draws per-rank micro-batches of sample indices; see the module docstring for the math."""

    def __init__(
        self,
        num_samples: int,
        seed: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        independent: bool = False,
    ) -> None:
        if global_batch % (micro_batch * dp_size):
            raise ValueError(
                f"global batch {global_batch} is not a multiple of micro_batch·dp = "
                f"{micro_batch}·{dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_size {dp_size}")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.independent = independent
        """Independent uniform draws (``data.sampling=random``) instead of epoch permutations."""
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = 0
        self.skipped: list[tuple[int, int]] = []
        self.last_draws = (0, 0)
        """The global draw range ``[a, b)`` of the last :meth:`next_step`."""
        self._perm_epoch = -1
        self._perm = np.arange(0)

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def _sample(self, draws: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return draws % self.num_samples
        if self.independent:
            return (splitmix64(self.seed, draws) % np.uint64(self.num_samples)).astype(np.int64)
        out = np.empty_like(draws)
        for i, g in enumerate(draws):
            epoch = int(g) // self.num_samples
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                self._perm_epoch = epoch
            out[i] = self._perm[int(g) % self.num_samples]
        return out

    def next_step(self) -> list[np.ndarray]:
        """This rank's micro-batches (sample indices) for the next optimizer step."""
        self.consumed = self.next_draw()
        base, b, dp = self.consumed, self.micro_batch, self.dp_size
        micro = [
            self._sample(base + (m * dp + self.dp_rank) * b + np.arange(b, dtype=np.int64))
            for m in range(self.accumulation_steps)
        ]
        self.consumed += self.global_batch
        self.last_draws = (base, self.consumed)
        return micro

    def step_samples(self) -> np.ndarray:
        """The samples of the last step of :meth:`next_step` over every rank, in draw order
        (rank ``r``'s micro-batch ``m`` is the slice ``[(m·dp + r)·b, (m·dp + r + 1)·b)``)."""
        start, end = self.last_draws
        return self._sample(np.arange(start, end, dtype=np.int64))

    def next_draw(self) -> int:
        """Where the next step starts drawing: ``consumed`` moved past any skipped range."""
        position = self.consumed
        for start, end in self.skipped:
            if start <= position < end:
                position = end
        return position

    def skip(self, start: int, end: int) -> None:
        """Never train on global draws ``[start, end)`` (merged into ``skipped``)."""
        if end <= start:
            return
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self.skipped, (start, end)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.skipped = merged

    def state_dict(self) -> dict:
        state: dict = {
            "consumed": self.consumed,
            "seed": self.seed,
            "global_batch": self.global_batch,
        }
        if self.skipped:
            state["skipped"] = [list(r) for r in self.skipped]
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"its data order used trainer.seed={state['seed']}, this run uses "
                f"trainer.seed={self.seed}"
            )
        self.consumed = int(state["consumed"])
        self.skipped = [(int(a), int(b)) for a, b in state.get("skipped", [])]


class DataModule:
    """The train and validation datasets of a prepared folder, plus its tokenizer: packed
    text windows, or image-text samples (:mod:`mt_train.data.image_text`) when ``meta.json``
    says ``"kind": "image_text"``, packed several to a sequence with ``pack_samples``
    (``data.pack_samples``) in ``pack_order`` (``data.pack_order``; ``shuffled`` seeded by
    ``pack_seed``, the run's ``trainer.seed``); ``pad_images`` gives every image-text batch a
    fixed image count (:mod:`mt_train.data.image_text`, for a captured step)."""

    def __init__(
        self,
        folder: str | Path,
        seq_len: int,
        train_stride: int | None = None,
        pack_samples: bool = False,
        pad_images: bool = False,
        pack_order: str = "consecutive",
        pack_seed: int = 0,
    ) -> None:
        from mt_train.data.image_text import KIND, ImageTextDataset

        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        kind = json.loads(meta_path.read_text()).get("kind") if meta_path.is_file() else None
        self.train: PackedDataset | ImageTextDataset
        self.val: PackedDataset | ImageTextDataset
        if kind == KIND:
            packing = (pack_samples, pad_images, pack_order, pack_seed)
            self.train = ImageTextDataset(folder, "train", seq_len, *packing)
            self.val = ImageTextDataset(folder, "val", seq_len, *packing)
        elif pack_samples:
            raise ValueError(
                f"data.pack_samples=true packs image-text samples, but {str(folder)!r} holds "
                "text, whose windows are packed already (data.document_masking=true keeps "
                "attention inside each document)"
            )
        else:
            self.train = PackedDataset(folder, "train", seq_len, train_stride)
            self.val = PackedDataset(folder, "val", seq_len)
        meta = self.train.meta
        self.tokenizer: Tokenizer = load_tokenizer(folder, meta["tokenizer"], meta["eos_token"])
        self.vocab_size = int(meta["vocab_size"])
