"""mt-fp8: FP8 formats, scaling recipes, FP8 GEMM dispatch, FP8 linear layers and fused ops."""

from mt_fp8.autocast import FP8AutocastState, current_fp8_state, fp8_autocast
from mt_fp8.convert import convert_to_fp8
from mt_fp8.formats import FormatConfig, FP8Format, TensorRole
from mt_fp8.functional import (
    FP8LinearFunction,
    FP8SwiGLULinearFunction,
    fp8_linear,
    fp8_swiglu_linear,
)
from mt_fp8.gemm import fp8_gemm
from mt_fp8.linear import FP8GroupedLinear, FP8Linear, clear_fp8_weight_caches
from mt_fp8.linear_plan import FP8_GEMMS, LinearPlan, parse_fp8_gemms
from mt_fp8.optim import FusedAdamW
from mt_fp8.quantized import (
    MIN_SCALE,
    ROWWISE,
    TENSORWISE,
    QuantizedTensor,
    ScaleLayout,
    quantize,
    scale_from_amax,
)
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
from mt_fp8.state import (
    FP8Meta,
    fp8_health,
    fp8_saturation_summary,
    reset_fp8_health,
    tie_input_scales,
    update_fp8_scales,
)
from mt_fp8.weight_cache import final_micro_batch
from mt_fp8.wgrad import WeightGradSink

__version__ = "0.1.0"

__all__ = [
    "MIN_SCALE",
    "RECIPES",
    "ROWWISE",
    "TENSORWISE",
    "BlockScaling",
    "DelayedScaling",
    "FP8AutocastState",
    "FP8GroupedLinear",
    "FP8Linear",
    "FP8LinearFunction",
    "FP8_GEMMS",
    "FP8Meta",
    "FP8SwiGLULinearFunction",
    "LinearPlan",
    "FP8Format",
    "FormatConfig",
    "FusedAdamW",
    "MXFP8Scaling",
    "QuantizedTensor",
    "Recipe",
    "RowwiseScaling",
    "ScaleLayout",
    "TensorRole",
    "TensorwiseScaling",
    "WeightGradSink",
    "__version__",
    "clear_fp8_weight_caches",
    "convert_to_fp8",
    "current_fp8_state",
    "final_micro_batch",
    "fp8_autocast",
    "fp8_health",
    "fp8_saturation_summary",
    "fp8_linear",
    "fp8_swiglu_linear",
    "parse_fp8_gemms",
    "fp8_gemm",
    "quantize",
    "recipe_from_name",
    "reset_fp8_health",
    "scale_from_amax",
    "tie_input_scales",
    "update_fp8_scales",
]
