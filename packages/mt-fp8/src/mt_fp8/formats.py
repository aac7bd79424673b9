"""FP8 formats and the tensor roles they are assigned to.

Two 8-bit floating-point formats from the OCP FP8 spec (both as PyTorch implements them):

=======  ========  ========  ==========  ==============  =================  ==========
format   exponent  mantissa  max finite  min normal      min subnormal      torch dtype
=======  ========  ========  ==========  ==============  =================  ==========
E4M3     4 bits    3 bits    448         2^-6            2^-9               float8_e4m3fn
E5M2     5 bits    2 bits    57344       2^-14           2^-16              float8_e5m2
=======  ========  ========  ==========  ==============  =================  ==========

Round-to-nearest-even into a format with ``m`` mantissa bits has a relative error of at most
``2^-(m+1)`` for values in the normal range (``2^-4`` for E4M3, ``2^-3`` for E5M2); below the
normal range the *absolute* error is at most half the subnormal spacing (``2^-10`` for E4M3,
``2^-17`` for E5M2, in scaled units). Casts saturate: ``|x| > max`` becomes ``±max``.

Tensor roles: the hybrid default (Transformer Engine's ``Format.HYBRID``) uses E4M3, the more
precise format, for the forward tensors (input activations and weights) and E5M2, the wider range,
for the output gradients whose dynamic range is larger.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class FP8Format(enum.Enum):
    """An FP8 format; ``.value`` is its lower-case name (``"e4m3"``)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is FP8Format.E4M3 else torch.float8_e5m2

    @property
    def max(self) -> float:
        """Largest finite value; casts saturate to it."""
        return torch.finfo(self.dtype).max

    @property
    def saturation_threshold(self) -> float:
        """Magnitudes from here up would round above ``max`` without clamping: clipped values.

        Between ``max`` and ``max + ulp/2`` round-to-nearest lands on ``max`` anyway, so those
        are not counted as saturated (e.g. fp32 rounding of an amax-derived scale).
        """
        return self.max + 2.0 ** (self.emax - self.mantissa_bits - 1)

    @property
    def mantissa_bits(self) -> int:
        return 3 if self is FP8Format.E4M3 else 2

    @property
    def min_normal(self) -> float:
        return torch.finfo(self.dtype).smallest_normal

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value; anything below half of it flushes to zero."""
        return self.min_normal * 2.0**-self.mantissa_bits

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two the format holds (8 for E4M3, 15 for E5M2).

        The OCP microscaling spec calls it ``emax_elem``; MXFP8's shared exponent is
        ``floor(log2(amax)) - emax``.
        """
        return 8 if self is FP8Format.E4M3 else 15

    @property
    def relative_rounding_error(self) -> float:
        """Bound on |q - x| / |x| for values in the normal range: half an ulp, 2^-(m+1)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @classmethod
    def parse(cls, value: FP8Format | str) -> FP8Format:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown FP8 format {value!r}; valid formats: "
                f"{', '.join(repr(f.value) for f in cls)}"
            ) from None


class TensorRole(enum.IntEnum):
    """The three tensors a linear layer quantizes; the int value indexes per-role state."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


@dataclass(frozen=True)
class FormatConfig:
    """Which FP8 format each tensor role uses (default: hybrid, E4M3 forward / E5M2 gradients)."""

    input: FP8Format = FP8Format.E4M3
    """Format of the activations entering a linear layer."""
    weight: FP8Format = FP8Format.E4M3
    """Format of the weights."""
    grad_output: FP8Format = FP8Format.E5M2
    """Format of the gradients flowing back into a linear layer's output."""

    def __post_init__(self) -> None:
        for name in ("input", "weight", "grad_output"):
            object.__setattr__(self, name, FP8Format.parse(getattr(self, name)))

    def for_role(self, role: TensorRole) -> FP8Format:
        return (self.input, self.weight, self.grad_output)[int(role)]

    @classmethod
    def hybrid(cls) -> FormatConfig:
        return cls()

    @classmethod
    def all_e4m3(cls) -> FormatConfig:
        return cls(FP8Format.E4M3, FP8Format.E4M3, FP8Format.E4M3)
