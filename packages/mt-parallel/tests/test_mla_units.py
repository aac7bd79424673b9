"""YaRN RoPE scaling and multi-head latent attention on one process (float64 references)."""

from __future__ import annotations

import math

import pytest
import torch

import mt_parallel as mp
from mt_parallel.mla import MultiLatentAttention
from mt_parallel.yarn import YarnConfig, yarn_frequencies, yarn_mscale

transformers = pytest.importorskip("transformers")


def hf_yarn(head_dim: int, theta: float, cfg: YarnConfig) -> tuple[torch.Tensor, float, float]:
    """transformers' YaRN frequencies, table factor and MLA softmax scale for ``cfg``."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters, yarn_apply_mscale

    rope = {
        "rope_type": "yarn", "rope_theta": theta, "factor": cfg.factor,
        "original_max_position_embeddings": cfg.original_max_position,
        "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow, "mscale": cfg.mscale,
        "mscale_all_dim": cfg.mscale_all_dim,
    }  # fmt: skip
    config = transformers.DeepseekV3Config(
        qk_rope_head_dim=head_dim,
        max_position_embeddings=int(cfg.original_max_position * cfg.factor),
        rope_parameters=rope,
    )
    freqs, attention_factor = _compute_yarn_parameters(config)
    return freqs.double(), attention_factor, yarn_apply_mscale(rope, 1.0)


@pytest.mark.parametrize(
    ("head_dim", "theta", "cfg"),
    [
        # DeepSeek-V3 (factor 40, mscale = mscale_all_dim = 1) and V2-Lite (0.707 both).
        (64, 10000.0, YarnConfig(40.0, 4096, 32.0, 1.0, 1.0, 1.0)),
        (64, 10000.0, YarnConfig(40.0, 4096, 32.0, 1.0, 0.707, 0.707)),
        # mscale_all_dim 0: the tables carry m(s, 1); the softmax scale is untouched.
        (16, 500000.0, YarnConfig(8.0, 2048, 16.0, 2.0, 1.0, 0.0)),
        # mscale ≠ mscale_all_dim: a table factor ≠ 1.
        (32, 10000.0, YarnConfig(4.0, 1024, 32.0, 1.0, 1.0, 0.5)),
    ],
)
def test_yarn_matches_transformers(head_dim: int, theta: float, cfg: YarnConfig) -> None:
    freqs = yarn_frequencies(head_dim, theta, cfg)
    assert freqs.dtype == torch.float64
    reference, attention_factor, softmax_factor = hf_yarn(head_dim, theta, cfg)
    # transformers computes θ^(2i/d) and the ramp in float32: a few roundings of 2^-24 each.
    torch.testing.assert_close(freqs, reference, rtol=1e-6, atol=0.0)
    assert cfg.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert cfg.softmax_scale_factor == pytest.approx(softmax_factor, rel=1e-12)


def test_yarn_off_is_plain_rope_and_interpolates_slow_pairs() -> None:
    plain = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.equal(yarn_frequencies(64, 10000.0, YarnConfig()), plain)
    assert YarnConfig().attention_factor == YarnConfig().softmax_scale_factor == 1.0
    scaled = yarn_frequencies(64, 10000.0, YarnConfig(factor=40.0))
    assert torch.equal(scaled[:4], plain[:4])  # fast pairs (many turns over L0) kept
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 40.0, rtol=1e-15, atol=0.0)
    assert yarn_mscale(40.0, 1.0) == pytest.approx(0.1 * math.log(40.0) + 1.0, rel=1e-15)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"factor": 0.5}, "yarn.factor=0.5"),
        ({"original_max_position": 0}, "yarn.original_max_position=0"),
        ({"beta_fast": 1.0, "beta_slow": 2.0}, "beta_slow=2.0, beta_fast=1.0"),
        ({"mscale_all_dim": -1.0}, "yarn.mscale_all_dim=-1.0"),
    ],
)
def test_yarn_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        YarnConfig(**kwargs)


MLA_SHAPES = {"dim": 32, "num_heads": 4, "kv_lora_rank": 12, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 6, "v_head_dim": 10}  # fmt: skip
V3_YARN = YarnConfig(factor=40.0, original_max_position=16, mscale=1.0, mscale_all_dim=1.0)


def build_mla(q_lora_rank: int | None, yarn: YarnConfig, seed: int = 0) -> MultiLatentAttention:
    mla = MultiLatentAttention(**MLA_SHAPES, q_lora_rank=q_lora_rank, yarn=yarn).double()
    mp.init_weights(mla, seed)
    with torch.no_grad():  # non-trivial norm gains, so a skipped norm would show
        for norm in (mla.q_a_norm, mla.kv_a_norm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    return mla


def reference_mla(mla: MultiLatentAttention, x: torch.Tensor, positions: torch.Tensor):
    """MLA written out in float64 from its weights: einsums, explicit mask and softmax."""
    H, N, R, V = mla.num_heads, mla.nope_dim, mla.rope_dim, mla.v_dim
    B, S, _ = x.shape

    def rms(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w

    if mla.q_proj is not None:
        q = x @ mla.q_proj.weight.T
    else:
        q_a = rms(x @ mla.q_a_proj.weight.T, mla.q_a_norm.weight, mla.q_a_norm.eps)
        q = q_a @ mla.q_b_proj.weight.T
    q = q.view(B, S, H, N + R)
    kv_a = x @ mla.kv_a_proj.weight.T
    c, k_rot = kv_a[..., : mla.kv_lora_rank], kv_a[..., mla.kv_lora_rank :]
    kv = rms(c, mla.kv_a_norm.weight, mla.kv_a_norm.eps) @ mla.kv_b_proj.weight.T
    kv = kv.view(B, S, H, N + V)
    freqs = yarn_frequencies(R, 10000.0, mla.yarn)
    angles = positions.double()[:, None] * freqs
    cos = torch.cat([angles.cos()] * 2, -1) * mla.yarn.attention_factor
    sin = torch.cat([angles.sin()] * 2, -1) * mla.yarn.attention_factor

    def rotate(t: torch.Tensor) -> torch.Tensor:  # (B, S, h, R)
        t1, t2 = t[..., : R // 2], t[..., R // 2 :]
        return t * cos[:, None] + torch.cat([-t2, t1], -1) * sin[:, None]

    q_full = torch.cat([q[..., :N], rotate(q[..., N:])], -1)
    k_full = torch.cat([kv[..., :N], rotate(k_rot[:, :, None]).expand(B, S, H, R)], -1)
    scale = mla.yarn.softmax_scale_factor / math.sqrt(N + R)
    scores = torch.einsum("bshe,bthe->bhst", q_full, k_full) * scale
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    o = torch.einsum("bhst,bthv->bshv", probs, kv[..., N:]).reshape(B, S, H * V)
    return o @ mla.o_proj.weight.T


@pytest.mark.parametrize("q_lora_rank", [None, 10], ids=["no-q-lora", "q-lora"])
@pytest.mark.parametrize("yarn", [YarnConfig(), V3_YARN], ids=["plain-rope", "yarn40"])
def test_mla_matches_fp64_reference(q_lora_rank: int | None, yarn: YarnConfig) -> None:
    mla = build_mla(q_lora_rank, yarn)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, MLA_SHAPES["dim"], generator=gen, dtype=torch.float64)
    positions = torch.arange(7) + 30  # past original_max_position: the YaRN ramp matters
    got = mla(x, positions)
    # Both float64, the same math in another order (SDPA vs einsum): a few ulps of 1.1e-16.
    torch.testing.assert_close(got, reference_mla(mla, x, positions), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("q_lora_rank", [None, 10], ids=["no-q-lora", "q-lora"])
def test_mla_matches_transformers_attention(q_lora_rank: int | None) -> None:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    mla = build_mla(q_lora_rank, V3_YARN, seed=2)
    config = transformers.DeepseekV3Config(
        hidden_size=MLA_SHAPES["dim"], num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6,
        v_head_dim=10, rope_interleave=False, max_position_embeddings=16 * 40,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )  # fmt: skip
    config._attn_implementation = "eager"
    attention = hf.DeepseekV3Attention(config, layer_idx=0).double()
    names = {"kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm",
             "kv_b_proj": "kv_b_proj", "o_proj": "o_proj"}  # fmt: skip
    names.update(
        {"q_proj": "q_proj"} if q_lora_rank is None
        else {"q_a_proj": "q_a_proj", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b_proj"}
    )  # fmt: skip
    with torch.no_grad():
        for hf_name, mt_name in names.items():
            getattr(attention, hf_name).weight.copy_(getattr(mla, mt_name).weight)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, MLA_SHAPES["dim"], generator=gen, dtype=torch.float64)
    positions = torch.arange(7) + 30
    cos, sin = hf.DeepseekV3RotaryEmbedding(config)(x, positions[None].expand(2, -1))
    mask = torch.full((7, 7), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    expected, _ = attention(x, (cos, sin), mask)
    # transformers' YaRN frequencies are float32 (relative error ~1e-7 on angles up to 36 rad,
    # so ~4e-6 absolute on cos/sin at most); outputs are O(0.1): 1e-5 relative + 1e-6 absolute.
    torch.testing.assert_close(mla(x, positions), expected, rtol=1e-5, atol=1e-6)


def test_mla_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="qk_rope_head_dim=5 must be even"):
        MultiLatentAttention(**{**MLA_SHAPES, "qk_rope_head_dim": 5}, q_lora_rank=None)
    with pytest.raises(ValueError, match="kv_lora_rank=0"):
        MultiLatentAttention(**{**MLA_SHAPES, "kv_lora_rank": 0}, q_lora_rank=None)
    with pytest.raises(ValueError, match="tp=3 does not divide MLA num_heads=4"):
        MultiLatentAttention(**MLA_SHAPES, q_lora_rank=None).check_tp(3)


def test_block_fp8_keeps_a_kv_compression_of_unfit_width_high_precision() -> None:
    # DeepSeek-V3's kv_a_proj writes kv_lora_rank + rope = 576 values, not a multiple of the
    # 128x128 blocks: it stays high precision (named in a warning) and every other projection,
    # 128-divisible, runs in FP8. Here kv_a writes 128 + 64 = 192.
    import mt_fp8

    mla = MultiLatentAttention(
        dim=256, num_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64,
    )  # fmt: skip
    options = mp.FP8Options(recipe=mt_fp8.recipe_from_name("block"))
    with pytest.warns(UserWarning, match=r"1 linear\(s\) stay high precision.*divisible by 128: "
                      r"kv_a_proj \(256->192\)$"):  # fmt: skip
        mp.apply_fp8_options(mla, mp.ParallelizePlan(block_types=()), options)
    fp8 = {name: p.fp8_enabled for name, p in mla.named_children() if hasattr(p, "gemm")}
    assert fp8 == {"q_a_proj": True, "q_b_proj": True, "kv_a_proj": False, "kv_b_proj": True,
                   "o_proj": True}, fp8  # fmt: skip
    y = mla(torch.randn(1, 128, 256), torch.arange(128))
    assert y.shape == (1, 128, 256) and torch.isfinite(y).all()
