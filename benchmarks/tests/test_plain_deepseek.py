"""``benchmarks/plain_deepseek.py``, the plain-PyTorch reference of the DeepSeek throughput rows,
computes mt-train's DeepSeek model: from the same weights, the same loss and gradients.

Both run in float32 on the CPU (``torch._grouped_mm`` takes no float64), so they differ by
summation order, ~1e-7 relative per op: 1e-5 on the loss and 1e-4 of each gradient's largest
element leave room for that through a few layers, while a different YaRN table, softmax scale,
routing rule, auxiliary loss or norm moves the loss by 1e-3 or more. The smoke test runs the
throughput script's DeepSeek stacks at toy sizes.
"""

from __future__ import annotations

import dataclasses
import json

import plain_deepseek
import pytest
import torch
import train_throughput

from mt_parallel import YarnConfig
from mt_parallel.moe import MoEConfig
from mt_train.models import build_model
from mt_train.models.deepseek_v3 import SIZES

SEQ = 24
TINY = dict(
    vocab_size=96, dim=48, n_layers=3, n_heads=3, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=6, ffn_dim=80, first_k_dense=1,
)  # fmt: skip
CASES = {
    # V2-Lite's choices: full-rank query, softmax scores not renormalised, Switch aux loss,
    # YaRN 40 with mscale = mscale_all_dim; a short original context so the ramp is used.
    "v2_lite": dataclasses.replace(
        SIZES["deepseek_v2_lite"], **TINY,
        yarn=YarnConfig(factor=40.0, original_max_position=16, mscale=0.707, mscale_all_dim=0.707),
        moe=dataclasses.replace(SIZES["deepseek_v2_lite"].moe, num_experts=8, top_k=3,
                                expert_ffn_dim=12, aux_loss_coeff=0.1),
    ),
    # V3's scoring without groups: query compression, sigmoid scores renormalised and scaled.
    "v3_ungrouped": dataclasses.replace(
        SIZES["deepseek_v3_tiny"], **TINY, q_lora_rank=20, mtp_depth=0,
        yarn=YarnConfig(factor=4.0, original_max_position=16, mscale=1.0, mscale_all_dim=1.0),
        moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=12, score_function="sigmoid",
                      routed_scaling_factor=2.5, balancing="none", n_shared_experts=1),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_plain_deepseek_computes_mt_trains_model(case: str) -> None:
    cfg = CASES[case]
    mt = build_model(cfg, "cpu", seed=3).train()
    plain = plain_deepseek.PlainDeepSeek(cfg, SEQ)
    plain_deepseek.load_mt_state(plain, mt.state_dict())
    tokens = torch.randint(
        0, cfg.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )

    mt_loss = mt.loss(mt(tokens[:, :-1]), tokens[:, 1:])[0]
    mt_loss.backward()
    plain_loss = plain_deepseek.loss(plain, tokens)
    plain_loss.backward()

    assert plain_loss.item() == pytest.approx(mt_loss.item(), rel=1e-5)
    mt_grads = dict(mt.named_parameters())
    for name, p in plain.named_parameters():
        expected = mt_grads[name].grad
        scale = expected.abs().max().item()
        assert (p.grad - expected).abs().max().item() <= 1e-4 * max(scale, 1e-30), name


def test_plain_deepseek_refuses_what_it_does_not_compute() -> None:
    grouped = dataclasses.replace(SIZES["deepseek_v3_tiny"], vocab_size=96, mtp_depth=0)
    with pytest.raises(ValueError, match="n_group=4, balancing='aux_free'"):
        plain_deepseek.PlainDeepSeek(grouped, SEQ)
    with pytest.raises(ValueError, match="mtp_depth=1"):
        plain_deepseek.PlainDeepSeek(SIZES["deepseek_v3_tiny"], SEQ)


def test_throughput_script_runs_the_deepseek_stacks_at_toy_sizes(tmp_path) -> None:
    out = tmp_path / "rows.jsonl"
    code = train_throughput.main([
        "--tiny", "--model", "deepseek_v2_lite", "--in-process", "--warmup", "1", "--steps", "1",
        "--only", "ours_bf16,ours_fp8_rowwise,ref_compile_bf16", "--out", str(out),
    ])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0
    assert [r["stack"] for r in rows] == ["ours_bf16", "ours_fp8_rowwise", "ref_compile_bf16"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows
