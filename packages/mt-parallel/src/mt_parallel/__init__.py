"""mt-parallel: tensor, sequence, context, data and expert parallelism, recompute, and the decoder
layers (attention, SwiGLU MLP, MoE, RMSNorm, a pre-norm block) that model families are built from."""

from mt_parallel import moe
from mt_parallel.attention import Attention, CoreAttention, apply_rope, rope_cos_sin
from mt_parallel.block import DecoderBlock
from mt_parallel.checkpoint import (
    init_weights,
    layer_generator,
    merge_state_dicts,
    shard_state_dict,
    tp_shard_plan,
)
from mt_parallel.config import ParallelConfig, validate_cp_sequence, validate_tp_shapes
from mt_parallel.context_parallel import (
    context_parallel_attention,
    document_ids_from_cu_seqlens,
    load_balanced_positions,
    shard_sequence,
    unshard_sequence,
)
from mt_parallel.cross_entropy import (
    SequenceCrossEntropy,
    SequenceMean,
    sequence_mean_cross_entropy,
    vocab_parallel_cross_entropy,
)
from mt_parallel.data_parallel import (
    accumulate,
    all_reduce_gradients,
    apply_data_parallel,
    is_expert_parameter,
    set_fp8_weight_cache,
    start_gradient_average,
)
from mt_parallel.document_attention import (
    DOCUMENT_MASK_KERNELS,
    apply_document_mask_kernel,
    flex_document_attention,
    resolve_document_mask_kernel,
)
from mt_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelModule,
    VocabParallelEmbedding,
)
from mt_parallel.mappings import (
    all_gather_grad_rs,
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    reduce_scatter_grad_ag,
    scatter_to_group,
)
from mt_parallel.mlp import MLP, SwiGLU
from mt_parallel.norm import RMSNorm
from mt_parallel.optimizer import DistributedOptimizer, clip_grad_norm_
from mt_parallel.parallelize import (
    EXPERT_FORMATS,
    FP8Options,
    ParallelizePlan,
    apply_context_parallel,
    apply_fp8,
    apply_fp8_options,
    apply_tensor_parallel,
    expert_recipe,
    high_precision_linears,
    parallelize,
)
from mt_parallel.pipeline import (
    PipelineLayout,
    PipelineModule,
    PipelineSchedule,
    StageShapes,
    pipeline_chunks,
    pipeline_module,
)
from mt_parallel.recompute import apply_recompute, is_recomputed, recompute_module
from mt_parallel.ring_attention import ring_attention
from mt_parallel.rng import Dropout, RNGStatesTracker, get_rng_tracker, manual_seed

__version__ = "0.1.0"

from mt_parallel.mla import MultiLatentAttention, ReplicatedLinear
from mt_parallel.yarn import YarnConfig, yarn_cos_sin, yarn_frequencies, yarn_mscale

__all__ = [
    "MultiLatentAttention",
    "ReplicatedLinear",
    "YarnConfig",
    "MLP",
    "Attention",
    "ColumnParallelLinear",
    "CoreAttention",
    "DOCUMENT_MASK_KERNELS",
    "DecoderBlock",
    "DistributedOptimizer",
    "Dropout",
    "EXPERT_FORMATS",
    "FP8Options",
    "ParallelConfig",
    "ParallelizePlan",
    "PipelineLayout",
    "PipelineModule",
    "PipelineSchedule",
    "RNGStatesTracker",
    "RMSNorm",
    "RowParallelLinear",
    "SequenceCrossEntropy",
    "SequenceMean",
    "StageShapes",
    "SwiGLU",
    "TensorParallelModule",
    "VocabParallelEmbedding",
    "__version__",
    "accumulate",
    "all_gather_grad_rs",
    "all_reduce_gradients",
    "start_gradient_average",
    "apply_context_parallel",
    "apply_data_parallel",
    "apply_document_mask_kernel",
    "apply_fp8",
    "apply_fp8_options",
    "set_fp8_weight_cache",
    "apply_recompute",
    "apply_rope",
    "apply_tensor_parallel",
    "clip_grad_norm_",
    "context_parallel_attention",
    "copy_to_group",
    "document_ids_from_cu_seqlens",
    "flex_document_attention",
    "gather_from_group",
    "get_rng_tracker",
    "expert_recipe",
    "high_precision_linears",
    "init_weights",
    "is_expert_parameter",
    "is_recomputed",
    "layer_generator",
    "load_balanced_positions",
    "manual_seed",
    "merge_state_dicts",
    "moe",
    "parallelize",
    "pipeline_chunks",
    "pipeline_module",
    "recompute_module",
    "reduce_from_group",
    "reduce_scatter_grad_ag",
    "resolve_document_mask_kernel",
    "ring_attention",
    "rope_cos_sin",
    "scatter_to_group",
    "sequence_mean_cross_entropy",
    "shard_sequence",
    "shard_state_dict",
    "tp_shard_plan",
    "unshard_sequence",
    "validate_cp_sequence",
    "validate_tp_shapes",
    "vocab_parallel_cross_entropy",
    "yarn_cos_sin",
    "yarn_frequencies",
    "yarn_mscale",
]
