"""The generated shapes set (``data=shapes``): the generator is deterministic in its seed; every
caption says what the pixels show (colours, shapes and the relation read back here from the
image alone, independently of the generator); every colour, shape and relation word occurs in
the train split; held-out images are not training images; bad sizes and a model for other
images are refused; and ``vlm_tiny`` learns from it (its loss falls)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import train_checks

from mt_train import Trainer, compose_config, to_train_config
from mt_train.data import prepare_bundled
from mt_train.data.image_text import ImageTextDataset
from mt_train.data.shapes import IMAGE_SIZE, SHAPE_SIZE, generate_shapes, prepare_shapes
from mt_train.data.tokenizer import ByteTokenizer
from mt_train.errors import DataError

# The grammar of mt_train.data.shapes, restated; its order names the first object.
COLOURS = {(255, 0, 0): "red", (0, 255, 0): "green", (0, 0, 255): "blue", (255, 255, 0): "yellow"}
SHAPES = ("circle", "square", "triangle")
OBJECT = rf"a ({'|'.join(COLOURS.values())}) ({'|'.join(SHAPES)})"
CAPTION = re.compile(rf"{OBJECT} (left of|right of|above|below) {OBJECT}")
RGB_12 = ["model.vision.channels=3", f"model.vision.image_size={IMAGE_SIZE}"]
QUIET = ["logging.progress_bar=false", "checkpoint.enabled=false"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled set as ``data=shapes`` prepares it for ``vlm_tiny`` at 6-pixel patches."""
    folder = tmp_path_factory.mktemp("shapes")
    prepare_bundled(folder, val_every=5, name="shapes", image_tokens=4)
    return folder


def split_samples(folder: Path, split: str) -> tuple[np.ndarray, list[str]]:
    """Images and captions of a prepared split, read back through the trainer's dataset."""
    data = ImageTextDataset(folder, split, seq_len=10**9)
    captions = []
    for i in range(len(data)):
        ids, mask, _ = data.sample(i)
        captions.append(ByteTokenizer().decode(ids[mask == 1].tolist()))
    return np.asarray(data.images), captions


def runs(indices: np.ndarray) -> list[np.ndarray]:
    """Consecutive runs of sorted indices."""
    return np.split(indices, np.flatnonzero(np.diff(indices) > 1) + 1)


def read_scene(image_CHW: np.ndarray) -> str:
    """The caption of an image, read from its pixels: the lit pixels fall into two slabs along
    one axis (and one across it); each slab is one shape of one colour, named by how much of
    its bounding box it fills (square 25/25, circle 21/25, triangle 13/25 at 5 pixels)."""
    lit = image_CHW.any(axis=0)
    col_runs = runs(np.flatnonzero(lit.any(axis=0)))
    row_runs = runs(np.flatnonzero(lit.any(axis=1)))
    assert sorted([len(col_runs), len(row_runs)]) == [1, 2], "two shapes apart along one axis"
    axis = 1 if len(col_runs) == 2 else 0  # the axis (of rows, cols) along which they are apart
    objects = []
    for slab in col_runs if axis == 1 else row_runs:
        where = np.zeros_like(lit)
        if axis == 1:
            where[:, slab] = True
        else:
            where[slab, :] = True
        rows, cols = np.nonzero(lit & where)
        colours = {
            tuple(int(c) for c in image_CHW[:, r, c]) for r, c in zip(rows, cols, strict=True)
        }
        assert len(colours) == 1 and next(iter(colours)) in COLOURS, colours
        height, width = np.ptp(rows) + 1, np.ptp(cols) + 1
        assert (height, width) == (SHAPE_SIZE, SHAPE_SIZE)
        fill = len(rows) / (height * width)
        shape = "square" if fill > 0.95 else "circle" if fill > 0.7 else "triangle"
        objects.append(((COLOURS[next(iter(colours))], shape), (rows.mean(), cols.mean())))
    colour_order = list(COLOURS.values())
    objects.sort(key=lambda o: (colour_order.index(o[0][0]), SHAPES.index(o[0][1])))
    (first, (y1, x1)), (second, (y2, x2)) = objects
    assert first != second, "the two objects differ"
    if axis == 1:
        relation = "left of" if x1 < x2 else "right of"
    else:
        relation = "above" if y1 < y2 else "below"
    return f"a {first[0]} {first[1]} {relation} a {second[0]} {second[1]}"


def test_the_generator_is_deterministic_in_its_seed() -> None:
    images, captions = generate_shapes(300, seed=7)
    again, captions_again = generate_shapes(300, seed=7)
    other, other_captions = generate_shapes(300, seed=8)
    assert np.array_equal(images, again) and captions == captions_again
    assert not np.array_equal(images, other) and captions != other_captions
    assert images.shape == (300, 3, IMAGE_SIZE, IMAGE_SIZE) and images.dtype == np.uint8


@pytest.mark.parametrize("image_size", [IMAGE_SIZE, 11, 16])
def test_every_caption_says_what_the_pixels_show(image_size: int) -> None:
    images, captions = generate_shapes(300, seed=image_size, image_size=image_size)
    for image, caption in zip(images, captions, strict=True):
        assert CAPTION.fullmatch(caption), caption
        assert read_scene(image) == caption


def test_the_prepared_splits_cover_the_vocabulary_and_do_not_overlap(shapes: Path) -> None:
    train_images, train_captions = split_samples(shapes, "train")
    val_images, val_captions = split_samples(shapes, "val")
    images, captions = generate_shapes()
    held_out = np.arange(len(captions)) % 5 == 4  # write_image_text's rule at val_every=5
    assert np.array_equal(train_images, images[~held_out])
    assert np.array_equal(val_images, images[held_out])
    assert train_captions == [c for c, h in zip(captions, held_out, strict=True) if not h]
    assert val_captions == [c for c, h in zip(captions, held_out, strict=True) if h]
    # Every (colour, shape, relation) in the train split, as the object named first (all but
    # the last object can be) and as the second (all but the first).
    seen = set()
    for caption in train_captions:
        c1, s1, relation, c2, s2 = CAPTION.fullmatch(caption).groups()
        seen |= {("first", c1, s1, relation), ("second", c2, s2, relation)}
    objects = [(c, s) for c in COLOURS.values() for s in SHAPES]
    expected = {
        (role, c, s, r)
        for r in ("left of", "right of", "above", "below")
        for role, allowed in (("first", objects[:-1]), ("second", objects[1:]))
        for c, s in allowed
    }
    assert seen == expected
    train_set = {x.tobytes() for x in train_images}
    assert len(train_set) == len(train_images)
    assert not train_set & {x.tobytes() for x in val_images}


def test_a_prepared_folder_is_reused_only_for_the_same_image_tokens(shapes: Path) -> None:
    written = (shapes / "train.images").stat().st_mtime_ns
    assert prepare_shapes(shapes, 5, image_tokens=4)["image_tokens"] == 4
    assert (shapes / "train.images").stat().st_mtime_ns == written


def test_bad_sizes_and_models_are_refused(shapes: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"image_size=10 is too small .* image_size >= 11"):
        generate_shapes(10, image_size=10)
    with pytest.raises(ValueError, match=r"count=50000 must be between 1 and the 41184"):
        generate_shapes(50_000)
    with pytest.raises(ValueError, match=r"data.bundled=shapes .* needs a vision-language model"):
        prepare_bundled(tmp_path / "text", val_every=5, name="shapes")
    overrides = ["model=vlm_tiny", "data=shapes", f"data.path={shapes}", *QUIET]
    expected = r"image_shape=\[3, 12, 12\], but \[model\.vision\.channels, .*\] is \[1, 8, 8\]"
    with pytest.raises(DataError, match=expected):
        Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path / "run")


def test_vlm_tiny_learns_from_the_shapes(shapes: Path, tmp_path: Path) -> None:
    overrides = [
        "model=vlm_tiny", "data=shapes", f"data.path={shapes}", *RGB_12,
        "model.vision.patch_size=6", *QUIET, "trainer.max_steps=24", "trainer.eval_interval=24",
        "trainer.eval_batches=1", "trainer.global_batch_size=16", "trainer.micro_batch_size=16",
        "scheduler=constant", "scheduler.warmup_steps=4", "optimizer.lr=3e-3",
    ]  # fmt: skip
    losses = train_checks.fit(overrides, tmp_path)[1].losses
    # From ln(320) ≈ 5.8 nats (uniform over the vocabulary) towards the captions' fixed words
    # ("a", "of a", the letters after a word's first): under a quarter of the first step's.
    assert np.mean(losses[-4:]) < losses[0] / 4, losses
