"""YaRN RoPE scaling (Peng et al. 2023) as DeepSeek-V2/V3 use it: frequencies and two scales.

Shape suffixes: S positions, P = d/2 rotary pairs.

Math (``s`` = ``factor``, ``L0`` = ``original_max_position``, ``f_i = θ^(-2i/d)``)::

    dim(r)     = d · ln(L0 / (2π·r)) / (2 ln θ)          pair index that turns r times over L0
    lo, hi     = max(floor(dim(beta_fast)), 0), min(ceil(dim(beta_slow)), d-1)
    ramp_i     = clamp((i - lo) / (hi - lo), 0, 1)       (hi += 0.001 when lo == hi)
    f'_i       = f_i/s · ramp_i + f_i · (1 - ramp_i)     fast pairs kept, slow pairs interpolated
    m(s, a)    = 0.1·a·ln(s) + 1  (1 for s ≤ 1)
    cos/sin    · attention_factor = m(s, mscale) / m(s, mscale_all_dim)   (both set)
                                    m(s, 1)                                (otherwise)
    softmax scale · m(s, mscale_all_dim)²                 MLA only, when mscale_all_dim ≠ 0

These are Hugging Face's ``_compute_yarn_parameters`` and ``yarn_apply_mscale`` (truncate on),
which DeepSeek-V3's reference code matches; mt computes them in float64 and casts the tables.
``factor = 1`` turns the scaling off (plain RoPE, both scales 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class YarnConfig:
    """YaRN RoPE scaling parameters (module docstring); ``factor=1`` turns it off."""

    factor: float = 1.0
    """Context extension ``s``: slow rotary pairs have their frequency divided by it."""
    original_max_position: int = 4096
    """Context length ``L0`` of pre-training before the extension."""
    beta_fast: float = 32.0
    """Pairs turning more than ``beta_fast`` times over ``L0`` keep their frequency."""
    beta_slow: float = 1.0
    """Pairs turning fewer than ``beta_slow`` times over ``L0`` are fully interpolated."""
    mscale: float = 1.0
    """``a`` of the rotary tables' ``m(s, a)`` numerator."""
    mscale_all_dim: float = 0.0
    """``a`` of the denominator and of MLA's softmax-scale correction (0: neither)."""

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"yarn.factor={self.factor} must be >= 1 (1 turns YaRN off)")
        if not isinstance(self.original_max_position, int) or self.original_max_position < 1:
            raise ValueError(
                f"yarn.original_max_position={self.original_max_position!r} must be a positive "
                "integer"
            )
        if not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError(
                f"yarn needs 0 < beta_slow <= beta_fast, got beta_slow={self.beta_slow}, "
                f"beta_fast={self.beta_fast}"
            )
        if self.mscale < 0 or self.mscale_all_dim < 0:
            raise ValueError(
                f"yarn.mscale={self.mscale} and yarn.mscale_all_dim={self.mscale_all_dim} must "
                "be >= 0"
            )

    @property
    def enabled(self) -> bool:
        return self.factor != 1.0

    @property
    def attention_factor(self) -> float:
        """What the cos/sin tables are multiplied by."""
        if not self.enabled:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """What MLA multiplies its ``1/sqrt(d_qk)`` softmax scale by."""
        if not self.enabled or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """``m(s, a) = 0.1·a·ln(s) + 1`` (1 for ``s <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(head_dim: int, theta: float, cfg: YarnConfig) -> torch.Tensor:
    """Per-pair rotary frequencies ``f'_i`` (float64, shape ``d/2``) of the module docstring."""
    if head_dim % 2:
        raise ValueError(f"rotary head dim {head_dim} must be even")
    freqs_P = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not cfg.enabled:
        return freqs_P

    def correction_dim(rotations: float) -> float:
        turns = cfg.original_max_position / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp_P = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs_P / cfg.factor * ramp_P + freqs_P * (1 - ramp_P)


def yarn_cos_sin(
    positions_S: torch.Tensor, freqs_P: torch.Tensor, cfg: YarnConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos_SP``, ``sin_SP`` of ``p·f'_i`` times ``attention_factor``; fp64 angles, then cast."""
    angles_SP = positions_S.to(torch.float64)[:, None] * freqs_P.to(positions_S.device)
    scale = cfg.attention_factor
    return (angles_SP.cos() * scale).to(dtype), (angles_SP.sin() * scale).to(dtype)
