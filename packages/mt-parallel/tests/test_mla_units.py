"""YaRN RoPE scaling and multi-head latent attention on one process (float64 references)."""

from __future__ import annotations

import math

import pytest
import torch

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
