"""mt-fp8: FP8 formats, scaling recipes, FP8 GEMM dispatch, FP8 linear layers and fused ops."""

from mt_fp8.formats import FormatConfig, FP8Format, TensorRole
from mt_fp8.gemm import fp8_gemm
from mt_fp8.quantized import ROWWISE, TENSORWISE, QuantizedTensor, ScaleLayout, quantize
from mt_fp8.recipes import (
    RECIPES,
    BlockScaling,
    DelayedScaling,
    MXFP8Scaling,
    Recipe,
    RowwiseScaling,
    TensorwiseScaling,
    recipe_from_name,
)

__version__ = "0.1.0"

__all__ = [
    "RECIPES",
    "ROWWISE",
    "TENSORWISE",
    "BlockScaling",
    "DelayedScaling",
    "FP8Format",
    "FormatConfig",
    "MXFP8Scaling",
    "QuantizedTensor",
    "Recipe",
    "RowwiseScaling",
    "ScaleLayout",
    "TensorRole",
    "TensorwiseScaling",
    "__version__",
    "fp8_gemm",
    "quantize",
    "recipe_from_name",
]
