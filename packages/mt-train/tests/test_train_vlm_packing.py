"""Packed image-text samples (``data.pack_samples``): several samples per sequence with their
own images, attention inside each sample, RoPE positions restarting per sample, and losses
and gradients equal to the same samples run one per sequence; and the validation loss as
the masked mean over every evaluated target."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mt_train.data import DataModule
from mt_train.data.image_text import IGNORE_INDEX, ImageTextDataset
from mt_train.data.prepare import main as prepare_main
from mt_train.models import build_model, model_sizes
from mt_train.models.llama.model import LlamaAttention
from mt_train.models.vlm.model import positions_within_documents

SEQ_LEN = 48
IMAGE_TOKENS = 4  # vlm_tiny's: 8x8 grey images in 4x4 patches


def prepare_varied(folder: Path, val_every: int = 11) -> DataModule:
    """Ten samples with zero, one or two 8x8 grey images and captions of varied length, and an
    eleventh, packed into ``SEQ_LEN``-token rows (every ``val_every``-th held out: by default
    only the eleventh)."""
    rng = np.random.default_rng(0)
    records = []
    for i in range(10):
        n_images = i % 3
        prompt = "".join(["<image>"] * n_images) + ("look" if i % 2 else "")
        images = [rng.integers(0, 256, (8, 8)).tolist() for _ in range(n_images)]
        records.append({"images": images, "prompt": prompt, "text": "x" * (2 + i)})
    records.append({"images": [], "text": "held out"})
    path = folder / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    arguments = [str(path), "--out", str(folder / "out"), "--image-text", "--image-shape"]
    arguments += ["1", "8", "8", "--image-tokens", str(IMAGE_TOKENS), "--val-every", str(val_every)]
    assert prepare_main(arguments) == 0
    return DataModule(folder / "out", SEQ_LEN, pack_samples=True)


def test_packs_hold_consecutive_samples_with_document_ids_and_counts(tmp_path: Path) -> None:
    data = prepare_varied(tmp_path)
    train = data.train
    lengths = np.diff(train.starts) - 1
    packs = [list(train.row_samples(p)) for p in range(len(train))]
    assert [i for pack in packs for i in pack] == list(range(10))  # every sample, once, in order
    for pack in packs:  # greedy: each pack fits, and the next sample would not have
        assert lengths[pack].sum() <= SEQ_LEN
        if pack[-1] + 1 < 10:
            assert lengths[pack].sum() + lengths[pack[-1] + 1] > SEQ_LEN
    batch = train.collate(np.arange(len(train)))
    for row, pack in enumerate(packs):
        docs = batch.document_ids[row]
        for k, i in enumerate(pack):  # sample k of the row: its own inputs under id k
            ids, _, _ = train.sample(i)
            where = (docs == k).nonzero().flatten()
            assert where.tolist() == list(range(int(where[0]), int(where[0]) + len(ids) - 1))
            assert batch.inputs[row, where].tolist() == ids[:-1].tolist()
        assert (docs[lengths[pack].sum() :] == len(pack)).all()  # padding: its own document
    images_per_row = [sum(len(train.sample(i)[2]) for i in pack) for pack in packs]
    assert len(set(images_per_row)) > 1 and batch.images.shape[0] == sum(images_per_row)
    # The token weights' counts are the collated rows' trained targets.
    trained = (batch.targets != IGNORE_INDEX).sum(1).tolist()
    assert train.target_counts(np.arange(len(train))).tolist() == trained


def test_positions_restart_at_each_document() -> None:
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3, 3]])
    want = [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4, 0, 0, 1]]
    assert positions_within_documents(docs).tolist() == want


def packed_and_unpacked(tmp_path: Path):
    """A float64 vlm_tiny (no dropout), the packed rows and the same samples one per row."""
    data = prepare_varied(tmp_path)
    train = data.train
    cfg = dataclasses.replace(model_sizes()["vlm_tiny"], vocab_size=320, dropout=0.0)
    model = build_model(cfg, "cpu", seed=1).double()
    rows = np.arange(len(train))
    packed = train.collate(rows)
    samples = [i for p in rows for i in train.row_samples(int(p))]
    single = ImageTextDataset(data.folder, "train", SEQ_LEN)
    unpacked = single.collate(np.asarray(samples))
    return model, packed, unpacked, samples


def run(model, batch):
    """Per-token cross-entropy (0 where masked), the model's loss, and the parameter grads."""
    model.zero_grad()
    extra = model.sequence_inputs(batch.inputs, batch.targets, batch.document_ids)
    logits = model(batch.inputs, None, batch.document_ids, batch.images.double(), **extra)
    loss, counts = model.loss(logits, batch.targets)
    loss.backward()
    ce = torch.nn.functional.cross_entropy(
        logits.detach().transpose(1, 2), batch.targets, ignore_index=IGNORE_INDEX, reduction="none"
    )
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return ce, loss.detach(), counts, grads


def test_packed_losses_and_gradients_equal_unpacked_in_float64(tmp_path: Path) -> None:
    model, packed, unpacked, samples = packed_and_unpacked(tmp_path)
    ce_p, loss_p, counts_p, grads_p = run(model, packed)
    ce_u, loss_u, counts_u, grads_u = run(model, unpacked)
    # Each sample's summed loss: packed, by its document id; unpacked, its own row.
    per_sample_packed = []
    for row in range(packed.inputs.shape[0]):
        docs = packed.document_ids[row]
        for k in range(int(docs.max())):  # the last id is the padding
            per_sample_packed.append(ce_p[row][docs == k].sum())
    per_sample_unpacked = ce_u.sum(1)
    assert len(per_sample_packed) == len(samples)
    # fp64: the same sums of products in other orders (longer masked rows, another RoPE
    # table row for the same position); losses of order 10 agree to ~1e-13.
    torch.testing.assert_close(
        torch.stack(per_sample_packed), per_sample_unpacked, rtol=1e-10, atol=1e-10
    )
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-12, atol=1e-12)
    assert counts_p["loss_tokens"] == counts_u["loss_tokens"]
    for name, grad in grads_u.items():
        torch.testing.assert_close(grads_p[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_a_sample_cannot_see_another_and_positions_restart(tmp_path: Path) -> None:
    model, packed, _, _ = packed_and_unpacked(tmp_path)
    model.eval()
    seen: list[torch.Tensor] = []
    hook = model.language.layers[0].attention.register_forward_pre_hook(
        lambda module, args: seen.append(args[1])
    )
    assert isinstance(model.language.layers[0].attention, LlamaAttention)
    extra = model.sequence_inputs(packed.inputs, packed.targets, packed.document_ids)
    with torch.no_grad():
        logits = model(packed.inputs, None, packed.document_ids, packed.images.double(), **extra)
    hook.remove()
    docs = packed.document_ids
    assert torch.equal(seen[0], positions_within_documents(docs))  # the decoder's RoPE positions
    for row in range(docs.shape[0]):
        for k in range(int(docs[row].max()) + 1):
            run_positions = seen[0][row][docs[row] == k]
            assert run_positions.tolist() == list(range(len(run_positions)))
    # Replace the first sample of row 0 (tokens and images): nothing after it in the row moves.
    first = docs[0] == 0
    inputs = packed.inputs.clone()
    inputs[0, first] = torch.where(inputs[0, first] == 257, 257, (inputs[0, first] + 7) % 256)
    images = packed.images.double().clone()
    n_first = int((packed.inputs[0, first] == 257).sum()) // IMAGE_TOKENS
    images[:n_first] += 1
    with torch.no_grad():
        other = model(inputs, None, docs, images, **extra)
    assert (other[0, first] - logits[0, first]).abs().max() > 1e-3  # the change is visible
    # Later samples' logits: the same fp64 products, masked keys contribute exact zeros.
    torch.testing.assert_close(other[0, ~first], logits[0, ~first], rtol=0, atol=1e-12)
    torch.testing.assert_close(other[1:], logits[1:], rtol=0, atol=0)


def test_pack_samples_refuses_text_data(tmp_path: Path) -> None:
    from mt_train import compose_config, to_train_config

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "meta.json").write_text(json.dumps({"format": 1, "tokenizer": "byte"}))
    with pytest.raises(ValueError, match=r"data\.pack_samples=true packs image-text samples"):
        DataModule(tmp_path / "text", 32, pack_samples=True)
    packed = ["model=vlm_tiny", "data=digits", "data.pack_samples=true"]
    cfg = to_train_config(compose_config([*packed, "trainer.cuda_graph=true"]))  # no refusal
    assert cfg.data.pack_samples and cfg.trainer.cuda_graph


def test_padded_images_give_a_fixed_count_and_change_nothing(tmp_path: Path) -> None:
    # trainer.cuda_graph's fixed shapes: every batch carries rows x (most images a row of the
    # split holds) images, its own first; the padding takes no placeholder, so in float64 the
    # loss and every gradient are the unpadded batch's.
    model, packed, _, _ = packed_and_unpacked(tmp_path)
    train = DataModule(tmp_path / "out", SEQ_LEN, pack_samples=True, pad_images=True).train
    per_row = [
        sum(len(train.sample(i)[2]) for i in train.row_samples(p)) for p in range(len(train))
    ]
    assert train.row_images == max(per_row) and min(per_row) < max(per_row)
    for rows in (np.arange(len(train)), np.asarray([int(np.argmin(per_row))])):
        batch = train.collate(rows)
        assert batch.images.shape[0] == len(rows) * max(per_row)
        own = sum(per_row[r] for r in rows)
        assert batch.images.shape[0] > own and not batch.images[own:].any()
    padded = train.collate(np.arange(len(train)))
    torch.testing.assert_close(padded.images[: packed.images.shape[0]], packed.images)
    # Unannounced padding is a count mismatch, as before.
    with pytest.raises(ValueError, match=r"image placeholder tokens .* for \d+ images"):
        run(model, padded)
    _, loss, counts, grads = run(model, packed)
    model.image_placement.set_image_padding(True)
    _, loss_padded, counts_padded, grads_padded = run(model, padded)
    # fp64: the encoder runs on more images (other GEMM row counts), the decoder is unchanged.
    torch.testing.assert_close(loss_padded, loss, rtol=1e-12, atol=1e-12)
    assert counts_padded["loss_tokens"] == counts["loss_tokens"]
    for name, grad in grads.items():
        torch.testing.assert_close(grads_padded[name], grad, rtol=1e-9, atol=1e-12, msg=name)
    # More placeholders than images, or a partial image, are still refused.
    short = dataclasses.replace(padded, images=padded.images[: packed.images.shape[0] - 1])
    with pytest.raises(ValueError, match=r"for at most \d+ images"):
        run(model, short)


def test_trainer_runs_packed_digits(digits: Path, tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")
    import train_checks

    # 64 tokens hold three digits samples (19 inputs each: 4 image tokens, "a handwritten 7").
    overrides = [
        "model=vlm_tiny", "data=digits", f"data.path={digits}", "data.pack_samples=true",
        "trainer.seq_len=64", "trainer.max_steps=3", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4", "trainer.log_interval=1", "trainer.eval_interval=3",
        "trainer.eval_batches=1", "scheduler.warmup_steps=1", "checkpoint.enabled=false",
        "logging.progress_bar=false",
    ]  # fmt: skip
    run = train_checks.run_logged(overrides, tmp_path)
    rows = [r for r in run["rows"] if r["kind"] == "train"]
    assert len(rows) == 3 and all(np.isfinite(run["losses"]))
    # Each caption trains 16 targets ("a handwritten d" and EOS); the logged count is a
    # micro-batch's (the mean of a step's): 3 samples in each of 4 rows.
    assert [r["loss_tokens"] for r in rows] == [3 * 16 * 4] * 3


def test_validation_loss_is_the_masked_mean_over_every_evaluated_target(tmp_path: Path) -> None:
    import train_checks

    from mt_train import Trainer

    data = prepare_varied(tmp_path, val_every=2)  # five held-out samples, captions of 3-11 bytes
    overrides = [
        "model=vlm_tiny", f"data.path={data.folder}", f"trainer.seq_len={SEQ_LEN}",
        "trainer.micro_batch_size=2", "trainer.global_batch_size=2", "trainer.eval_batches=2",
        "checkpoint.enabled=false", "logging.progress_bar=false",
    ]  # fmt: skip
    trainer = Trainer(
        train_checks.to_train_config(train_checks.compose_config(overrides)), output_dir=tmp_path
    )
    try:
        val_loss = trainer.evaluate()
        # The same four samples (two micro-batches of two) as one batch: its masked mean.
        batch = trainer.data.val.collate(np.arange(4))
        trainer.module.eval()
        with torch.no_grad():
            logits = trainer.module(batch.inputs, None, None, batch.images)
            want = trainer.module.loss(logits, batch.targets)[0]
        counts = trainer.data.val.target_counts(np.arange(4))
        assert counts[:2].sum() != counts[2:].sum()  # unequal micro-batches: weights matter
    finally:
        trainer.close()
    # fp32: the same cross-entropies summed in another grouping, ~1e-7 relative of a loss ~6.
    assert val_loss == pytest.approx(want.item(), rel=1e-5)
