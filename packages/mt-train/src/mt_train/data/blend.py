"""Weighted blends of prepared folders (``data.blend``): which source each global draw reads.

Sources ``s = 0..n-1`` with weights ``w_s`` (normalised to ``p_s = w_s / Σw``) and ``S_s``
packed samples each. The draws ``g = 0, 1, 2, ...`` of :class:`~mt_train.data.dataset.ResumableSampler`
are cut into blocks of ``B = BLOCK`` draws. Every block gives source ``s`` exactly ``n_s``
draws, the largest-remainder apportionment of ``B`` by ``p`` (so ``|n_s - B·p_s| < 1``),
in an order that is a permutation of that multiset drawn from
``numpy.random.default_rng([seed, b])`` for block ``b``. Hence

* the source of draw ``g`` and its rank ``k`` among its source's draws,
  ``k = (g div B)·n_s + #{draws of s before g in its block}``, are fixed functions of the
  seed and ``g``, whatever the rank, the data-parallel layout or the resume point: every layout
  of one global batch trains on the same samples, a checkpoint keeps only ``consumed``, and
  skipped draw ranges (rewind) skip exactly those draws;
* over any whole blocks the proportions are exact up to one draw per block; inside a block they
  are those of sampling without replacement (within sampling error of ``p``).

Source ``s`` maps its ``k``-th draw to one of its samples with its own epoch permutations
(or independent draws), seeded ``splitmix64(seed, s)``, as a single-source run does. Sample
indices handed to :meth:`BlendedDataset.collate` are global: ``offset_s + i`` for sample ``i``
of source ``s`` (``offset_s = Σ_{t<s} S_t``).

Megatron's flat ``"w1 path1 w2 path2"`` string is accepted as well as a list of
``{path, weight}``. All sources must share one tokenizer (same ``meta.json`` tokenizer name,
end-of-document id and vocabulary, and the same ``tokenizer.json`` bytes).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mt_train.data.dataset import Batch, DataModule, PackedDataset, ResumableSampler, splitmix64
from mt_train.errors import DataError

BLOCK = 4096
"""Draws per blend block: proportions are exact up to one draw in every block."""


def parse_blend(value: Any) -> list[tuple[str, float]]:
    """``[(path, normalised weight), ...]`` from a list of ``{path, weight}`` or Megatron's flat
    ``"w1 path1 w2 path2"`` string; raises ``ValueError`` naming the bad entry."""
    if isinstance(value, str):
        parts = value.split()
        if not parts or len(parts) % 2:
            raise ValueError(
                f"data.blend={value!r} is not 'weight path weight path ...' (an even number of "
                "words)"
            )
        entries: list[tuple[Any, Any]] = [(parts[i + 1], parts[i]) for i in range(0, len(parts), 2)]
    elif isinstance(value, Sequence) and value:
        entries = []
        for item in value:
            if not isinstance(item, Mapping) or set(item) != {"path", "weight"}:
                raise ValueError(f"data.blend entry {item!r} is not {{path, weight}}")
            entries.append((item["path"], item["weight"]))
    else:
        raise ValueError(
            f"data.blend={value!r} is neither a list of {{path, weight}} nor 'w1 path1 w2 path2'"
        )
    parsed: list[tuple[str, float]] = []
    for path, weight in entries:
        try:
            number = float(weight)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number <= 0:
            raise ValueError(f"data.blend weight {weight!r} of {path!r} is not a positive number")
        parsed.append((str(path), number))
    total = sum(w for _, w in parsed)
    return [(p, w / total) for p, w in parsed]


def apportion(total: int, weights: Sequence[float]) -> np.ndarray:
    """Largest-remainder split of ``total`` by ``weights`` (which sum to 1)."""
    exact = np.asarray(weights, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return counts


def tokenizer_identity(folder: Path, meta: dict[str, Any]) -> tuple[str, ...]:
    """What two folders must share to be blended: tokenizer name, eos id, vocabulary size and
    the sha256 of the tokenizer file (if any)."""
    name = str(meta["tokenizer"])
    digest = "" if name == "byte" else hashlib.sha256((folder / name).read_bytes()).hexdigest()
    return (name, str(meta["eos_id"]), str(meta["vocab_size"]), digest[:16])


def check_same_tokenizer(folders: Sequence[Path], metas: Sequence[dict[str, Any]]) -> None:
    """Raise :class:`DataError` (one line, naming both folders) unless all share a tokenizer."""
    first = tokenizer_identity(folders[0], metas[0])
    for folder, meta in zip(folders[1:], metas[1:], strict=True):
        other = tokenizer_identity(folder, meta)
        if other != first:
            describe = "{} (eos {}, vocab {}, sha256 {})".format
            raise DataError(
                f"data.blend sources use different tokenizers: {folders[0]} has "
                f"{describe(*first)}, {folder} has {describe(*other)}; prepare both with the same "
                "--tokenizer"
            )


class BlendedDataset:
    """Several :class:`PackedDataset` of one split as one index space (module docstring)."""

    def __init__(self, parts: Sequence[PackedDataset], names: Sequence[str]) -> None:
        self.parts, self.names = list(parts), list(names)
        sizes = np.array([len(p) for p in parts], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.meta = parts[0].meta

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """Source number of each global sample index."""
        return np.searchsorted(self.offsets, np.asarray(indices), side="right") - 1

    def collate(self, indices: np.ndarray, documents: bool = False) -> Batch:
        indices = np.asarray(indices, dtype=np.int64)
        sources = self.source_of(indices)
        rows: list[Batch | None] = [None] * len(indices)
        for s in np.unique(sources):
            where = np.flatnonzero(sources == s)
            batch = self.parts[s].collate(indices[where] - self.offsets[s], documents)
            for j, row in enumerate(where):
                docs = None if batch.document_ids is None else batch.document_ids[j : j + 1]
                rows[row] = Batch(batch.inputs[j : j + 1], batch.targets[j : j + 1], docs)
        done = [r for r in rows if r is not None]
        docs = None if not documents else torch.cat([r.document_ids for r in done])  # type: ignore[misc]
        return Batch(
            torch.cat([r.inputs for r in done]), torch.cat([r.targets for r in done]), docs
        )


class BlendedSampler(ResumableSampler):
    """:class:`ResumableSampler` whose draws are dealt to sources by weight (module docstring)."""

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float],
        seed: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        independent: bool = False,
    ) -> None:
        super().__init__(
            int(sum(sizes)), seed, global_batch, micro_batch, dp_rank, dp_size,
            independent=independent,
        )  # fmt: skip
        self.weights = [float(w) for w in weights]
        self.per_block = apportion(BLOCK, self.weights)
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
        source_seeds = splitmix64(seed, np.arange(len(sizes))) >> np.uint64(33)
        self.sources = [
            ResumableSampler(int(n), int(sd), global_batch, micro_batch, independent=independent)
            for n, sd in zip(sizes, source_seeds, strict=True)
        ]
        self._block = -1
        self._block_sources = np.arange(0)
        self._block_ranks = np.arange(0)

    def _deal(self, block: int) -> None:
        """Source and in-block rank of every draw of ``block`` (cached)."""
        if block == self._block:
            return
        sources = np.repeat(np.arange(len(self.weights)), self.per_block)
        sources = np.random.default_rng([self.seed, block]).permutation(sources)
        ranks = np.empty(BLOCK, dtype=np.int64)
        for s in range(len(self.weights)):
            where = sources == s
            ranks[where] = np.arange(int(where.sum()))
        self._block, self._block_sources, self._block_ranks = block, sources, ranks

    def source_draws(self, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source ``s`` and rank ``k`` among that source's draws, for each global draw."""
        sources = np.empty(len(draws), dtype=np.int64)
        ranks = np.empty(len(draws), dtype=np.int64)
        for i, g in enumerate(np.asarray(draws, dtype=np.int64)):
            block, within = divmod(int(g), BLOCK)
            self._deal(block)
            s = int(self._block_sources[within])
            sources[i] = s
            ranks[i] = block * int(self.per_block[s]) + int(self._block_ranks[within])
        return sources, ranks

    def draws_before(self, g: int) -> np.ndarray:
        """How many of the draws ``[0, g)`` each source received."""
        block, within = divmod(int(g), BLOCK)
        self._deal(block)
        partial = np.bincount(self._block_sources[:within], minlength=len(self.weights))
        return block * self.per_block + partial

    def trained_draws(self) -> np.ndarray:
        """Draws each source has given to training: ``[0, consumed)`` less skipped ranges."""
        counts = self.draws_before(self.consumed)
        for start, end in self.skipped:
            end = min(end, self.consumed)
            if start < end:
                counts = counts - (self.draws_before(end) - self.draws_before(start))
        return counts

    def _sample(self, draws: np.ndarray) -> np.ndarray:
        sources, ranks = self.source_draws(draws)
        out = np.empty(len(draws), dtype=np.int64)
        for s in np.unique(sources):
            where = sources == s
            out[where] = self.offsets[s] + self.sources[s]._sample(ranks[where])
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "blend_weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("blend_weights")
        if saved is not None and not np.allclose(saved, self.weights, rtol=0, atol=1e-12):
            raise ValueError(
                f"its data order used data.blend weights {saved}, this run uses {self.weights}"
            )
        super().load_state_dict(state)


def data_order_change(saved: Mapping[str, Any], sampler: ResumableSampler) -> str | None:
    """A warning line when a checkpoint's data order came from one folder and this run blends
    (``data.blend``), or the other way round: the consumed count carries over, but the samples
    drawn from there on follow this run's order, not the checkpointed run's."""
    blended_before = "blend_weights" in saved
    blended_now = isinstance(sampler, BlendedSampler)
    if blended_before == blended_now:
        return None
    before, now = ("one folder", "data.blend") if blended_now else ("data.blend", "one folder")
    return (
        f"the checkpoint's samples were drawn from {before}, this run draws from {now}: it "
        f"continues after sample {int(saved['consumed'])} in its own order, so the samples "
        f"from here on differ from what the checkpointed run would have drawn"
    )


def source_names(folders: Sequence[Path]) -> list[str]:
    """Metric names of the sources: each folder's name, numbered where two share one."""
    names = [Path(f).name or str(f) for f in folders]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


class BlendedDataModule(DataModule):
    """The train and validation splits of several prepared folders, each blended."""

    def __init__(
        self,
        sources: Sequence[tuple[str | Path, float]],
        seq_len: int,
        train_stride: int | None = None,
    ) -> None:
        folders = [Path(f) for f, _ in sources]
        super().__init__(folders[0], seq_len, train_stride)
        self.folders, self.weights = folders, [w for _, w in sources]
        self.names = source_names(folders)
        self.train = BlendedDataset(  # type: ignore[assignment]
            [PackedDataset(f, "train", seq_len, train_stride) for f in folders], self.names
        )
        self.val = BlendedDataset(  # type: ignore[assignment]
            [PackedDataset(f, "val", seq_len) for f in folders], self.names
        )

    def sampler(
        self, seed: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
        independent: bool,
    ) -> BlendedSampler:  # fmt: skip
        sizes = [len(p) for p in self.train.parts]  # type: ignore[attr-defined]
        return BlendedSampler(
            sizes, self.weights, seed, global_batch, micro_batch, dp_rank, dp_size, independent
        )
