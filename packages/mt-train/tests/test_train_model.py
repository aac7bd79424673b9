"""The Llama: published shapes build on meta, RoPE scaling, FLOP count, tp-independent init,
document masking of packed sequences."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mt_parallel
from mt_train import compose_config, to_train_config
from mt_train.data import ByteTokenizer, PackedDataset
from mt_train.data.prepare import write_prepared
from mt_train.models import build_model, get_family
from mt_train.models.llama import LlamaConfig, RopeScalingConfig, flops_per_token, rope_frequencies

LLAMA = get_family("llama")

# Parameter counts Meta publishes (Llama 3.2 1B is counted untied: +128256·2048 for the head).
PUBLISHED = {
    "llama3_1b": 1_235_814_400 + 128_256 * 2048,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_large_models_build_on_meta(name: str) -> None:
    cfg = to_train_config(compose_config([f"model={name}"])).model
    model = build_model(cfg, "meta")
    assert LLAMA.num_params(model) == PUBLISHED[name]
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.embed.weight is not model.output.weight  # untied


def _hf_llama3_inv_freq(head_dim: int, theta: float, s: RopeScalingConfig) -> list[float]:
    """Transcription of Hugging Face's ``_compute_llama3_parameters``, one frequency at a time."""
    out = []
    for i in range(0, head_dim, 2):
        f = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_position / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_position / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out


def test_rope_scaling_matches_reference() -> None:
    scaling = RopeScalingConfig()
    got = rope_frequencies(128, 500000.0, scaling)
    want = torch.tensor(_hf_llama3_inv_freq(128, 500000.0, scaling), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    unscaled = rope_frequencies(128, 500000.0, RopeScalingConfig(factor=1.0))
    assert got[0] == unscaled[0] and got[-1] == unscaled[-1] / 8.0


def test_flops_per_token_matches_design_doc_anchor() -> None:
    # The design doc's anchor: the 8-layer 8B shape at 8192 tokens, 29.4k tok/s ≈ 50% of 989 TFLOP/s.
    cfg = to_train_config(compose_config(["model=llama3_8b", "model.n_layers=8"])).model
    mfu = flops_per_token(cfg, 8192) * 29.4e3 / 989e12
    assert 0.49 < mfu < 0.51


def test_forward_shapes_and_determinism(kjv_data) -> None:
    cfg = to_train_config(compose_config(["model.vocab_size=320"])).model
    a, b = build_model(cfg, "cpu", seed=3), build_model(cfg, "cpu", seed=3)
    tokens = torch.randint(0, 320, (2, 16))
    logits = a(tokens)
    assert logits.shape == (2, 16, 320)
    assert torch.equal(logits, b(tokens))
    assert a.loss(logits, tokens).item() == pytest.approx(math.log(320), rel=0.1)


@torch.no_grad()
@pytest.mark.parametrize("kernel", ["explicit", "flex"])
def test_document_masking_loss_is_the_sum_of_per_document_losses(
    tmp_path: Path, kernel: str
) -> None:
    docs = ["In the beginning", "God created the heaven and the earth.", "And", "the earth was"]
    write_prepared(tmp_path, docs * 4, ByteTokenizer(), val_every=16)
    batch = PackedDataset(tmp_path, "train", seq_len=48).collate(np.arange(2), documents=True)
    assert batch.document_ids is not None and int(batch.document_ids.max()) >= 2
    cfg = LlamaConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    model = build_model(cfg, "cpu", seed=5).double()
    mt_parallel.apply_document_mask_kernel(model, kernel)  # flex: forward only on the CPU

    def ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, 320), targets.reshape(-1), reduction="sum")

    packed = ce_sum(model(batch.inputs, None, batch.document_ids), batch.targets)
    separate = torch.zeros((), dtype=torch.float64)
    for row, ids in enumerate(batch.document_ids):
        for doc in ids.unique():
            where = (ids == doc).nonzero().squeeze(1)  # one contiguous run per document
            span = slice(int(where[0]), int(where[-1]) + 1)
            separate += ce_sum(model(batch.inputs[row : row + 1, span]), batch.targets[row, span])
    # float64 throughout: the two sides differ only by rounding (masked keys add exact zeros;
    # RoPE sees shifted absolute positions, the same relative ones), ~1e-15 relative per op.
    torch.testing.assert_close(packed, separate, rtol=1e-10, atol=0)
    unmasked = ce_sum(model(batch.inputs), batch.targets)
    # Without the mask later documents see earlier ones: off by ~4e-4 relative for this
    # random model, 10^6 times the tolerance above.
    assert abs(unmasked - separate) > 1e-6 * separate
