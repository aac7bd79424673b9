"""Greedy captions of held-out images and the digits learning check.

:func:`greedy_captions` decodes each validation sample from its prompt (everything before the
first trained target: the image tokens and any prompt text) by repeated argmax, recomputing
the whole prefix each token (short captions; no cache), and stops at EOS. The digits check
(:func:`digit_accuracy`) counts captions whose first digit is the sample's own (the digit in
its reference caption); :func:`logistic_regression_accuracy` is the baseline a model must at
least match: scikit-learn's logistic regression on the same pixels and the same split.

``python -m mt_train.models.vlm.captions <checkpoint>`` prints both for a run trained with
``data=digits`` (the manifest records its data folder under ``tokenizer``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mt_train.data.image_text import ImageTextDataset
from mt_train.data.tokenizer import ByteTokenizer

DIGIT = re.compile(r"[0-9]")


@torch.no_grad()
def greedy_captions(
    model: nn.Module, data: ImageTextDataset, indices: Sequence[int], max_new_tokens: int = 24,
    batch_size: int = 64,
) -> tuple[list[str], list[str]]:  # fmt: skip
    """``(generated, reference)`` caption texts of samples ``indices`` (module docstring)."""
    tokenizer = ByteTokenizer()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    generated: list[str] = []
    references: list[str] = []
    for start in range(0, len(indices), batch_size):
        prompts, images = [], []
        for i in indices[start : start + batch_size]:
            ids, mask, pixels = data.sample(int(i))
            first = int(np.argmax(mask == 1))
            prompts.append(torch.from_numpy(ids[:first]))
            references.append(tokenizer.decode(ids[first:].tolist()))
            images.append(data.normalize(pixels))
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1:
            raise ValueError("greedy_captions needs prompts of one length in a batch")
        tokens = torch.stack(prompts).to(device)
        pixels = torch.cat(images).to(device)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        out = []
        for _ in range(max_new_tokens):
            logits = model(tokens, images=pixels)[:, -1]
            nxt = logits.argmax(-1)
            out.append(nxt)
            done |= nxt == data.eos_id
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            if bool(done.all()):
                break
        rows = torch.stack(out, dim=1).tolist()
        for row in rows:
            cut = row.index(data.eos_id) if data.eos_id in row else len(row)
            generated.append(tokenizer.decode(row[:cut]))
    model.train(was_training)
    return generated, references


def first_digit(text: str) -> str | None:
    match = DIGIT.search(text)
    return match.group(0) if match else None


def digit_accuracy(generated: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of captions naming their reference's digit."""
    hits = [
        first_digit(g) is not None and first_digit(g) == first_digit(r)
        for g, r in zip(generated, references, strict=True)
    ]
    return float(np.mean(hits))


def digits_split(data_folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pixels (flattened, [0, 1]) and labels of the train and val splits of a digits folder."""
    out = []
    for split in ("train", "val"):
        data = ImageTextDataset(data_folder, split, seq_len=10**9)
        labels = []
        for i in range(len(data)):
            ids, mask, _ = data.sample(i)
            labels.append(int(first_digit(ByteTokenizer().decode(ids[mask == 1].tolist()))))
        out += [np.asarray(data.images, np.float64).reshape(len(data), -1) / 255.0, labels]
    return out[0], np.asarray(out[1]), out[2], np.asarray(out[3])


def logistic_regression_accuracy(data_folder: Path, seed: int = 0) -> float:
    """Held-out accuracy of scikit-learn's logistic regression on the same split."""
    from sklearn.linear_model import LogisticRegression

    x_train, y_train, x_val, y_val = digits_split(data_folder)
    classifier = LogisticRegression(max_iter=2000, random_state=seed).fit(x_train, y_train)
    return float(classifier.score(x_val, y_val))


def main(argv: Sequence[str] | None = None) -> int:
    from mt_train.checkpoint.files import CheckpointReader, checkpoint_folder
    from mt_train.hf_checkpoints import load_model

    parser = argparse.ArgumentParser(
        prog="python -m mt_train.models.vlm.captions",
        description="Greedy caption accuracy of a data=digits run on its held-out images.",
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint folder or root")
    args = parser.parse_args(argv)
    reader = CheckpointReader(checkpoint_folder(args.checkpoint))
    folder = Path((reader.manifest.get("tokenizer") or {}).get("folder", ""))
    if not (folder / "meta.json").is_file():
        print(
            f"captions: error: the checkpoint's data folder {str(folder)!r} is gone",
            file=sys.stderr,
        )
        return 2
    model = load_model(args.checkpoint)
    val = ImageTextDataset(folder, "val", seq_len=10**9)
    generated, references = greedy_captions(model, val, list(range(len(val))))
    result = {
        "captions": len(generated),
        "accuracy": digit_accuracy(generated, references),
        "logistic_regression": logistic_regression_accuracy(folder),
        "examples": [[g, r] for g, r in list(zip(generated, references, strict=True))[:5]],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
