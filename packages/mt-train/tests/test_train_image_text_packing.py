"""Packing orders of image-text samples (``data.pack_order``): every order puts each sample in
exactly one pack that fits the sequence; ``consecutive`` is the greedy file-order cut;
``shuffled`` is that cut over a seeded permutation; ``best_fit`` is Best-Fit-Decreasing, equal
to a plain quadratic implementation and never using more packs than ``consecutive`` on random
lengths (strictly fewer on a written-out case). A best-fit row holds its samples exactly as
they are built one per row, the padding share is the rows' padding, bad settings are refused,
and a packed best-fit run on the digits resumes exactly."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import train_checks
from test_train_vlm_packing import SEQ_LEN, prepare_varied

from mt_train import compose_config, to_train_config
from mt_train.data import DataModule
from mt_train.data.image_text import (
    IGNORE_INDEX,
    PACK_SHUFFLE_STREAM,
    ImageTextDataset,
    ImageTextError,
    build_packs,
    pack_boundaries,
)
from mt_train.data.prepare import main as prepare_main
from mt_train.models.vlm.model import positions_within_documents

ORDERS = ("consecutive", "shuffled", "best_fit")


def packs_of(offsets: np.ndarray, samples: np.ndarray) -> list[list[int]]:
    return [samples[a:b].tolist() for a, b in itertools.pairwise(offsets)]


def random_lengths(seed: int, n: int, seq_len: int) -> np.ndarray:
    """Sample input lengths in ``[0, seq_len]``, skewed short as captions are."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.geometric(3 / seq_len, n), seq_len)


def plain_best_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Best-Fit-Decreasing as written in the module docstring, scanning every pack."""
    packs: list[list[int]] = []
    rooms: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [p for p in range(len(packs)) if rooms[p] >= lengths[i]]
        if fits:
            best = min(fits, key=lambda p: (rooms[p], p))
        else:
            best = len(packs)
            packs.append([])
            rooms.append(seq_len)
        packs[best].append(i)
        rooms[best] -= lengths[i]
    return [sorted(pack) for pack in packs]


@pytest.mark.parametrize("order", ORDERS)
def test_every_sample_in_exactly_one_pack_that_fits(order: str) -> None:
    for seed in range(5):
        lengths = random_lengths(seed, 200, 64)
        offsets, samples = build_packs(lengths, 64, order, seed=seed)
        assert sorted(samples.tolist()) == list(range(200))
        assert offsets[0] == 0 and offsets[-1] == 200 and (np.diff(offsets) > 0).all()
        assert all(lengths[pack].sum() <= 64 for pack in packs_of(offsets, samples))


def test_consecutive_is_the_greedy_file_order_cut() -> None:
    offsets, samples = build_packs(np.array([3, 4, 2, 5, 1, 7, 6]), 7)
    assert samples.tolist() == list(range(7))
    assert offsets.tolist() == [0, 2, 4, 5, 6, 7]  # [3 4] [2 5] [1] [7] [6]
    lengths = random_lengths(0, 300, 48)
    offsets, samples = build_packs(lengths, 48, "consecutive")
    assert np.array_equal(offsets, pack_boundaries(lengths, 48))
    assert np.array_equal(samples, np.arange(300))


def test_best_fit_packs_no_more_than_consecutive_and_fewer_on_a_constructed_case() -> None:
    for seed in range(20):
        lengths = random_lengths(seed, 300, 64)
        best = len(build_packs(lengths, 64, "best_fit")[0]) - 1
        consecutive = len(build_packs(lengths, 64, "consecutive")[0]) - 1
        assert best <= consecutive
    # T = 10: in file order [6] [5 4] [5] (6+5 and 9+5 overflow); longest first, 6 opens a
    # pack (room 4), 5 opens one (room 5), the second 5 fills it, 4 fills the first.
    offsets, samples = build_packs(np.array([6, 5, 4, 5]), 10, "consecutive")
    assert packs_of(offsets, samples) == [[0], [1, 2], [3]]
    offsets, samples = build_packs(np.array([6, 5, 4, 5]), 10, "best_fit")
    assert packs_of(offsets, samples) == [[0, 2], [1, 3]]


def test_best_fit_equals_the_plain_reference() -> None:
    for seed in range(30):
        rng = np.random.default_rng(seed)
        seq_len = int(rng.integers(4, 24))
        lengths = rng.integers(0, seq_len + 1, int(rng.integers(1, 40)))  # many ties
        want = plain_best_fit(lengths.tolist(), seq_len)
        assert packs_of(*build_packs(lengths, seq_len, "best_fit")) == want, (seed, lengths)


def test_shuffled_cuts_a_seeded_permutation() -> None:
    lengths = random_lengths(3, 100, 32)
    offsets, samples = build_packs(lengths, 32, "shuffled", seed=7)
    permutation = np.random.default_rng([7, PACK_SHUFFLE_STREAM]).permutation(100)
    assert np.array_equal(samples, permutation)
    assert np.array_equal(offsets, pack_boundaries(lengths[permutation], 32))
    again = build_packs(lengths, 32, "shuffled", seed=7)
    assert np.array_equal(again[0], offsets) and np.array_equal(again[1], samples)
    other = build_packs(lengths, 32, "shuffled", seed=8)[1]
    assert sorted(other.tolist()) == list(range(100)) and not np.array_equal(other, samples)


def prepare_lengths(folder: Path) -> Path:
    """The constructed case at T = 20: train inputs 12 (4 image tokens, 8 bytes), 10, 8, 10;
    consecutive packs [12] [10 8] [10], best fit [12 8] [10 10]. A fifth sample is held out."""
    records = [{"image": np.zeros((8, 8), int).tolist(), "prompt": "<image>", "text": "x" * 8}]
    records += [{"text": "y" * n} for n in (10, 8, 10, 5)]  # n bytes and EOS: n inputs
    path = folder / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    arguments = [str(path), "--out", str(folder / "out"), "--image-text", "--image-shape"]
    assert prepare_main([*arguments, "1", "8", "8", "--image-tokens", "4", "--val-every", "5"]) == 0
    return folder / "out"


def test_padding_fraction_is_the_rows_padding(tmp_path: Path) -> None:
    folder = prepare_lengths(tmp_path)
    fractions = {}
    for order in ORDERS:
        train = DataModule(folder, 20, pack_samples=True, pack_order=order, pack_seed=1).train
        assert (np.diff(train.starts) - 1).tolist() == [12, 10, 8, 10]
        batch = train.collate(np.arange(len(train)))
        padding = sum(
            int((batch.document_ids[row] == len(train.row_samples(row))).sum())
            for row in range(len(train))
        )
        assert train.padding_fraction == pytest.approx(padding / batch.inputs.numel(), abs=1e-12)
        fractions[order] = train.padding_fraction
    assert fractions["consecutive"] == pytest.approx(1 / 3) and fractions["best_fit"] == 0.0
    unpacked = ImageTextDataset(folder, "train", 20)
    assert unpacked.padding_fraction == pytest.approx(1 - 40 / 80)


def test_a_best_fit_row_holds_its_samples_as_built_one_by_one(tmp_path: Path) -> None:
    data = prepare_varied(tmp_path)
    train = ImageTextDataset(data.folder, "train", SEQ_LEN, pack=True, pack_order="best_fit")
    single = ImageTextDataset(data.folder, "train", SEQ_LEN)
    packs = [train.row_samples(p).tolist() for p in range(len(train))]
    # Worked out in the module docstring's rule from the inputs 2 11 12 9 10 19 8 17 18 15.
    assert packs == [[1, 5, 8], [0, 2, 7, 9], [3, 4, 6]]
    batch = train.collate(np.arange(len(train)))
    positions = positions_within_documents(batch.document_ids)
    image_at = 0
    for row, pack in enumerate(packs):
        offset = 0
        for k, i in enumerate(pack):
            one = single.collate(np.asarray([i]))
            n = len(train.sample(i)[0]) - 1
            span = slice(offset, offset + n)
            assert batch.inputs[row, span].tolist() == one.inputs[0, :n].tolist()
            assert batch.targets[row, span].tolist() == one.targets[0, :n].tolist()
            assert batch.document_ids[row, span].tolist() == [k] * n
            assert positions[row, span].tolist() == list(range(n))
            n_images = one.images.shape[0]
            assert np.array_equal(batch.images[image_at : image_at + n_images], one.images)
            image_at += n_images
            offset += n
        assert (batch.document_ids[row, offset:] == len(pack)).all()
        assert (batch.targets[row, offset:] == IGNORE_INDEX).all()
        assert (batch.inputs[row, offset:] == train.eos_id).all()
    assert image_at == batch.images.shape[0]
    trained = (batch.targets != IGNORE_INDEX).sum(1).tolist()
    assert train.target_counts(np.arange(len(train))).tolist() == trained
    # Sample i has i % 3 images: rows of 1 + 2 + 2, 0 + 2 + 1 + 0 and 0 + 1 + 0 images.
    assert train.row_images == 5 and batch.images.shape[0] == 5 + 3 + 1


def test_bad_pack_settings_are_refused(tmp_path: Path) -> None:
    packed = ["model=vlm_tiny", "data=digits", "data.pack_samples=true"]
    assert to_train_config(compose_config([*packed, "data.pack_order=best_fit"])).data.pack_order
    with pytest.raises(ValueError, match=r"data\.pack_order='tightest' is unknown; valid: "
                       r"consecutive, shuffled, best_fit"):  # fmt: skip
        to_train_config(compose_config([*packed, "data.pack_order=tightest"]))
    with pytest.raises(ValueError, match=r"data\.pack_order=best_fit .* data\.pack_samples=false"):
        to_train_config(
            compose_config(["model=vlm_tiny", "data=digits", "data.pack_order=best_fit"])
        )
    folder = prepare_lengths(tmp_path)
    with pytest.raises(ValueError, match=r"set data\.pack_samples=true"):
        ImageTextDataset(folder, "train", 20, pack_order="shuffled")
    # A sample longer than the sequence is refused whatever the order.
    with pytest.raises(ImageTextError, match=r"sample 0 .* 13 tokens, more than trainer\.seq_len"):
        ImageTextDataset(folder, "train", 11, pack=True, pack_order="best_fit")
    with pytest.raises(ValueError, match=r"sample 1 has 9 inputs, more than a pack's 8"):
        build_packs(np.array([3, 9]), 8, "best_fit")


def test_packed_best_fit_digits_run_resumes_exactly(digits: Path, tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")
    # 64 tokens hold three digits samples; vlm_tiny's dropout on, so the checkpoint's RNG
    # state must make the resumed masks the same.
    base = {
        "model": "vlm_tiny", "data": "digits", "data.path": digits, "data.pack_samples": True,
        "data.pack_order": "best_fit", "trainer.seq_len": 64, "trainer.global_batch_size": 4,
        "trainer.micro_batch_size": 2, "trainer.checkpoint_interval": 3, "trainer.eval_interval": 6,
        "trainer.eval_batches": 1, "trainer.log_interval": 3, "scheduler": "constant",
        "scheduler.warmup_steps": 1,
        "logging.progress_bar": False, "checkpoint.async_save": False,
    }  # fmt: skip

    def overrides(**extra: object) -> list[str]:
        return [f"{k}={v}" for k, v in {**base, **extra}.items()]

    trainer, full = train_checks.fit(overrides(**{"trainer.max_steps": 6}), tmp_path / "full")
    assert trainer.data.train.pack_order == "best_fit" and "best_fit packs" in trainer.describe()
    train_checks.run_losses(overrides(**{"trainer.max_steps": 3}), tmp_path / "run")
    resumed = train_checks.run_losses(
        overrides(**{"trainer.max_steps": 6, "checkpoint.resume": "auto"}), tmp_path / "run"
    )
    assert len(resumed) == 3 and resumed == full.losses[3:]  # exact floats, step by step
