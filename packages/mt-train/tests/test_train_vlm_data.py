"""Image-text data: mt-prepare-data's image-text format, the digits caption set, and one-line
errors naming the sample for bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from mt_train.data import DataModule
from mt_train.data.image_text import IGNORE_INDEX, ImageTextDataset, ImageTextError
from mt_train.data.prepare import main as prepare_main
from mt_train.data.prepare import prepare_bundled


def write_jsonl(folder: Path, records: list[dict]) -> Path:
    path = folder / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def good_records(folder: Path, n: int = 6) -> list[dict]:
    rng = np.random.default_rng(0)
    records = []
    for i in range(n):
        np.save(folder / f"img{i}.npy", rng.integers(0, 256, (3, 4, 4)).astype(np.uint8))
        records.append({"image": f"img{i}.npy", "prompt": "<image>what?", "text": f"no {i}"})
    # A sample with two images, one inline and one from a file, both placeholders in the prompt.
    inline = rng.integers(0, 256, (3, 4, 4)).tolist()
    records.append({"images": [inline, "img0.npy"], "prompt": "<image> and <image>", "text": "x"})
    return records


def prepare(folder: Path, records: list[dict], *extra: str) -> int:
    path = write_jsonl(folder, records)
    return prepare_main(
        [str(path), "--out", str(folder / "out"), "--image-text", "--image-shape", "3", "4", "4",
         "--image-tokens", "4", "--val-every", "2", *extra]
    )  # fmt: skip


def test_image_text_round_trip(tmp_path: Path) -> None:
    records = good_records(tmp_path)
    assert prepare(tmp_path, records) == 0
    data = DataModule(tmp_path / "out", seq_len=24)
    assert isinstance(data.train, ImageTextDataset) and data.vocab_size == 258
    assert len(data.train) == 4 and len(data.val) == 3  # records 1, 3, 5 held out
    batch = data.train.collate(np.array([3, 0]))  # the two-image sample, then sample 0
    assert batch.images is not None and batch.images.shape == (3, 3, 4, 4)
    # Image tokens and prompt carry no loss; the caption and EOS do.
    row = batch.targets[1].tolist()
    trained = [t for t in row if t != IGNORE_INDEX]
    assert bytes(trained[:-1]).decode() == "no 0" and trained[-1] == 256
    assert (batch.inputs[0] == 257).sum() == 8 and (batch.inputs[1] == 257).sum() == 4
    # Images come back normalised with the train split's statistics, in sample order.
    meta = data.train.meta
    first = np.load(tmp_path / "img0.npy")
    mean = torch.tensor(meta["pixel_mean"]).view(3, 1, 1)
    std = torch.tensor(meta["pixel_std"]).view(3, 1, 1)
    want = (torch.from_numpy(first).float() / 255 - mean) / std
    torch.testing.assert_close(batch.images[1], want)
    torch.testing.assert_close(batch.images[2], want)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r, d: r[2].update(image="missing.npy"), r"samples\.jsonl:3 image 0: image file .*missing\.npy.* does not exist"),
        (lambda r, d: (d / "bad.npy").write_text("not numpy") and r[1].update(image="bad.npy"), r"samples\.jsonl:2 image 0: .*bad\.npy.* is not a readable \.npy array"),
        (lambda r, d: r[0].update(image=np.zeros((3, 5, 4)).tolist()), r"samples\.jsonl:1 image 0: image of shape \(3, 5, 4\), expected \(3, 4, 4\)"),
        (lambda r, d: r[0].update(image=np.zeros((4, 4)).tolist()), r"samples\.jsonl:1 image 0: image of shape \(1, 4, 4\), expected \(3, 4, 4\)"),
        (lambda r, d: r[4].update(prompt="<image><image>"), r"samples\.jsonl:5: 2 <image> placeholders for 1 images"),
        (lambda r, d: r[3].update(text="y" * 40), r"samples\.jsonl:4: 50 tokens after expanding 1 images to 4 tokens each, more than the 32 allowed"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture, mutate, message: str
) -> None:
    records = good_records(tmp_path)
    mutate(records, tmp_path)
    assert prepare(tmp_path, records, "--max-tokens", "32") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mt-prepare-data: error: ")
    assert re.search(message, err), err


def test_sample_longer_than_the_sequence_is_refused_at_load(tmp_path: Path) -> None:
    records = good_records(tmp_path)
    records[0]["text"] = "z" * 30
    assert prepare(tmp_path, records) == 0
    with pytest.raises(
        ImageTextError, match=r"train sample 0 \(input line 1\) has 40 tokens, more"
    ):
        DataModule(tmp_path / "out", seq_len=24)


def test_digits_caption_set(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")
    meta = prepare_bundled(tmp_path, val_every=5, name="digits", image_tokens=16)
    assert meta["splits"]["train"]["samples"] == 1438 and meta["splits"]["val"]["samples"] == 359
    data = DataModule(tmp_path, seq_len=32)
    batch = data.val.collate(np.arange(3))
    captions = [bytes(t for t in row.tolist() if 0 <= t < 256).decode() for row in batch.targets]
    from sklearn.datasets import load_digits

    labels = load_digits().target[4::5][:3]  # record r is held out when r % 5 == 4
    assert captions == [f"a handwritten {d}" for d in labels]
    assert batch.images.shape == (3, 1, 8, 8)
    with pytest.raises(ValueError, match=r"data\.bundled=digits .* needs a vision-language model"):
        prepare_bundled(tmp_path / "other", name="digits")
