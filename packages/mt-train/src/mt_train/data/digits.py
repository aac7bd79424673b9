"""The bundled offline image-caption set: scikit-learn's handwritten digits (1,797 8×8 grey
images, shipped inside the scikit-learn wheel; ``pip install 'mt-train[vision]'``).

Each image becomes ``{"images": [x], "prompt": "<image>", "text": "a handwritten 7"}`` with
pixel values ``round(v · 255 / 16)`` (digits are 0..16), written with
:func:`mt_train.data.image_text.write_image_text` (every ``val_every``-th image held out).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mt_train.data.image_text import IMAGE_PLACEHOLDER, write_image_text

DIGIT_MAX = 16
"""The digits' largest pixel value."""
CAPTION = "a handwritten {}"


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images (1797, 8, 8) uint8 in [0, 255], labels)``; a clear error without sklearn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError("data=digits needs scikit-learn: pip install 'mt-train[vision]'") from err
    digits = load_digits()
    images = np.rint(digits.images * 255.0 / DIGIT_MAX).astype(np.uint8)
    return images, digits.target.astype(np.int64)


def digit_records(images: np.ndarray, labels: np.ndarray) -> Iterator[tuple[str, Path, Any]]:
    for r, (image, label) in enumerate(zip(images, labels, strict=True)):
        record = {"images": [image], "prompt": IMAGE_PLACEHOLDER, "text": CAPTION.format(label)}
        yield f"digits:{r}", Path("."), record


def prepare_digits(out: Path, val_every: int, image_tokens: int) -> dict[str, Any]:
    """Write (or reuse) the digits folder; ``image_tokens`` per image (the model's)."""
    meta_path = out / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("image_tokens") == image_tokens:
            return meta
    images, labels = load_digits_arrays()
    return write_image_text(out, digit_records(images, labels), (1, 8, 8), image_tokens, val_every)
