"""The bundled procedural image-caption set: two coloured shapes and the relation between them.

Each image is ``3 × IMAGE_SIZE × IMAGE_SIZE`` uint8 RGB, black but for two shapes, captioned
with where the first stands relative to the second::

    caption  := "a " object " " relation " a " object
    object   := colour " " shape
    colour   := "red" | "green" | "blue" | "yellow"        (255,0,0) (0,255,0) (0,0,255) (255,255,0)
    shape    := "circle" | "square" | "triangle"
    relation := "left of" | "right of" | "above" | "below"

e.g. ``"a red circle left of a blue square"``. Written with
:func:`mt_train.data.image_text.write_image_text` as ``{"images": [x], "prompt": "<image>",
"text": caption}`` (every ``val_every``-th image held out), like :mod:`mt_train.data.digits`.

Invariants (every image, any seed):

* Two objects ``(colour, shape)`` that differ (12 objects, 66 unordered pairs); each is drawn
  in its pure colour over a ``SHAPE_SIZE × SHAPE_SIZE`` box, pixel ``(i, j)`` lit when its
  centre ``(x, y) = (j + ½, i + ½)`` (box coordinates, y down) lies in the shape: square, all;
  circle, ``(x − s/2)² + (y − s/2)² ≤ (s/2)²``; triangle (apex up, base the bottom edge),
  ``|x − s/2| ≤ y/2``. At ``s = 5`` that lights 25, 21 and 13 of the box's 25 pixels, each
  shape reaching all four sides of its box: the fill ratios 1, 0.84 and 0.52 tell the shapes
  apart. 5 is the smallest size that does: at 3 the circle (a plus) and the triangle both
  light 5 of 9 pixels, and at 4 (even: no centre column) the triangle's top row is empty, its
  lit rows filling 8 of 12 pixels, near the circle's 12 of 16.
* The relation fixes the layout. ``X left of Y``: X's box lies entirely left of Y's with at
  least ``GAP`` black columns between them, and the two boxes share at least one row (so
  neither is above the other); ``right of`` mirrored; ``above``/``below`` the same with rows
  and columns swapped. Exactly one relation word (for a given order) is true of an image, and
  the gap keeps two shapes of one colour apart, so each shape is one connected patch of one
  colour. ``2·SHAPE_SIZE + GAP = 11`` pixels is the smallest side that fits this;
  ``IMAGE_SIZE = 12`` rounds it up to a multiple of 4 and 6 (4- or 6-pixel patches tile it).
* The caption is a function of the image: the object named first is the one earlier in the
  vocabulary's order (colour first, then shape: red circle, red square, …, yellow
  triangle), and the relation word says where it stands. So the caption needs both objects'
  colours and shapes and their positions; a model that reads only which objects are present
  gets the relation word right one time in four at best.

Drawing (deterministic in ``seed``, ``count`` and ``image_size``). A scene is a relation, an
unordered pair of objects (:data:`PAIRS`), the two boxes' offsets along the relation's axis,
``(a, b)`` with ``b ≥ a + SHAPE_SIZE + GAP`` (``a`` left or top: the first object's for
``left of``/``above``, else the second's), and their offsets across it, ``(u, v)`` with
``|u − v| < SHAPE_SIZE`` (the first object's ``u``); offsets are box corners in
``[0, image_size − SHAPE_SIZE]``. At 12 pixels that is 4 · 66 · 3 · 52 = 41,184 scenes
(:func:`scene_count`), scene ``k`` being ``numpy.unravel_index(k, (4, 66, 3, 52))``. ``count``
of them are drawn uniformly without replacement,
``numpy.random.default_rng(seed).choice(scenes, count, replace=False)``, in the order drawn.
Distinct scenes are distinct images (the pixels give back each box, colour and shape), so no
image repeats and the held-out images are never seen in training.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mt_train.data.image_text import IMAGE_PLACEHOLDER, write_image_text

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
}
SHAPES = ("circle", "square", "triangle")
RELATIONS = ("left of", "right of", "above", "below")
SHAPE_SIZE = 5
"""Side of each shape's box in pixels (module docstring: the smallest that tells them apart)."""
GAP = 1
"""Fewest black pixels between the two boxes along the relation's axis."""
MIN_IMAGE_SIZE = 2 * SHAPE_SIZE + GAP
IMAGE_SIZE = 12
"""The bundled set's side: :data:`MIN_IMAGE_SIZE` rounded up to a multiple of 4 and 6."""
COUNT = 4000
"""Images in the bundled set (``data=shapes``)."""
SEED = 29
CAPTION = "a {} {} {} a {} {}"
OBJECTS = [(c, s) for c in COLOURS for s in SHAPES]
"""Every ``(colour, shape)`` in the vocabulary's order, which decides the one named first."""
PAIRS = list(itertools.combinations(range(len(OBJECTS)), 2))
"""The 66 unordered pairs of objects as ``(first, second)`` indices into :data:`OBJECTS`."""


def shape_mask(shape: str, size: int = SHAPE_SIZE) -> np.ndarray:
    """The ``size × size`` boolean mask of ``shape`` (module docstring)."""
    centre = (np.arange(size) + 0.5)[None, :]
    depth = (np.arange(size) + 0.5)[:, None]
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "circle":
        return (centre - size / 2) ** 2 + (depth - size / 2) ** 2 <= (size / 2) ** 2
    if shape == "triangle":
        return np.abs(centre - size / 2) <= depth / 2
    raise ValueError(f"shape={shape!r} is unknown; valid: {', '.join(SHAPES)}")


def scene_count(image_size: int = IMAGE_SIZE) -> int:
    """How many distinct scenes (images) fit ``image_size`` (module docstring)."""
    return len(RELATIONS) * len(PAIRS) * math.prod(len(p) for p in _offsets(image_size))


def _offsets(image_size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The box-corner pairs along the relation's axis and across it (module docstring)."""
    side = range(image_size - SHAPE_SIZE + 1)
    apart = [(a, b) for a in side for b in side if b >= a + SHAPE_SIZE + GAP]
    level = [(u, v) for u in side for v in side if abs(u - v) < SHAPE_SIZE]
    return apart, level


def generate_shapes(
    count: int = COUNT, seed: int = SEED, image_size: int = IMAGE_SIZE
) -> tuple[np.ndarray, list[str]]:
    """``(images (count, 3, image_size, image_size) uint8, captions)`` (module docstring)."""
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(
            f"image_size={image_size} is too small for two {SHAPE_SIZE}-pixel shapes {GAP} "
            f"pixel apart; use image_size >= {MIN_IMAGE_SIZE}"
        )
    apart, level = _offsets(image_size)
    scenes = scene_count(image_size)
    if not 1 <= count <= scenes:
        raise ValueError(
            f"count={count} must be between 1 and the {scenes} distinct scenes of "
            f"image_size={image_size}"
        )
    drawn = np.random.default_rng(seed).choice(scenes, size=count, replace=False)
    sizes = (len(RELATIONS), len(PAIRS), len(apart), len(level))
    masks = {s: shape_mask(s) for s in SHAPES}
    paints = {c: np.asarray(rgb, np.uint8)[:, None] for c, rgb in COLOURS.items()}
    images = np.zeros((count, 3, image_size, image_size), dtype=np.uint8)
    captions = []
    scenes_drawn = zip(*(k.tolist() for k in np.unravel_index(drawn, sizes)), strict=True)
    for n, (r, p, i, j) in enumerate(scenes_drawn):
        relation, (a, b), (u, v) = RELATIONS[r], apart[i], level[j]
        first, second = (OBJECTS[k] for k in PAIRS[p])
        along = (a, b) if relation in ("left of", "above") else (b, a)
        corners = [(u, along[0]), (v, along[1])]  # (row, column) of each box, side by side
        if relation in ("above", "below"):
            corners = [(along[0], u), (along[1], v)]
        for (colour, shape), (row, col) in zip((first, second), corners, strict=True):
            box = images[n, :, row : row + SHAPE_SIZE, col : col + SHAPE_SIZE]
            box[:, masks[shape]] = paints[colour]
        captions.append(CAPTION.format(*first, relation, *second))
    return images, captions


def shape_records(images: np.ndarray, captions: Sequence[str]) -> Iterator[tuple[str, Path, Any]]:
    for r, (image, caption) in enumerate(zip(images, captions, strict=True)):
        record = {"images": [image], "prompt": IMAGE_PLACEHOLDER, "text": caption}
        yield f"shapes:{r}", Path("."), record


def prepare_shapes(out: Path, val_every: int, image_tokens: int) -> dict[str, Any]:
    """Write (or reuse) the shapes folder; ``image_tokens`` per image (the model's)."""
    shape = [3, IMAGE_SIZE, IMAGE_SIZE]
    meta_path = out / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("image_tokens") == image_tokens and meta.get("image_shape") == shape:
            return meta
    images, captions = generate_shapes()
    return write_image_text(out, shape_records(images, captions), shape, image_tokens, val_every)
