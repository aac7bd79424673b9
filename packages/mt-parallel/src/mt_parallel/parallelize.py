"""Transforms that turn a plain (tp=1) model into its parallel form, and the one function that
applies them in order, driven by the caller's :class:`ParallelizePlan`.

Order (each step assumes the previous ones; none edits model code):

1. **Tensor parallel** (:func:`apply_tensor_parallel`): check every module's divisibility first
   (``check_tp``), then cut each TP layer's full parameters to this rank's shard, switch the
   layers to SP if asked (except those the plan's ``sequence_parallel_skip`` names), and give
   every other module with a ``set_tensor_parallel(tp_group, sequence_parallel)`` hook (norms,
   dropouts, the attention core) the TP group. Parameters are *replaced*, so build optimizers
   after this step.
2. **Context parallel** (:func:`apply_context_parallel`): give every module with a
   ``set_context_parallel(cp_group, ring)`` hook (the attention cores) the cp group (and the
   all-gather or ring algorithm).
3. **FP8** (:func:`apply_fp8`, :func:`apply_fp8_options`): route the TP layers' local GEMMs
   through ``mt_fp8.FP8Linear``; comes after TP so the FP8 layers see the local shard shapes,
   and records the TP group as the amax-reduction group of each layer: delayed scaling agrees
   on one scale per layer at the update, current tensorwise scaling reduces the amax of each
   sharded tensor as it quantizes. The FP8 layers a module lists in ``shared_input_linears()``
   (q/k/v, gate/up) get tied input scales (``mt_fp8.tie_input_scales``), so delayed scaling
   quantizes their common input once per forward, as current scaling already does. The plan's
   output head stays high precision unless :attr:`FP8Options.output_head`, and then runs its
   own choice of FP8 GEMMs.
4. **Recompute** (:func:`mt_parallel.apply_recompute`): wraps the plan's blocks or the parts
   that declare a ``recompute_target``, so it sees the final (TP, FP8) modules it recomputes.
5. **Compile**: ``module.compile()`` on each block in place (after recompute, so the checkpoint
   region is inside the compiled block).
6. **Data parallel** (:func:`mt_parallel.apply_data_parallel`): last, because DDP/FSDP2 capture
   the parameters and module structure the earlier steps produce (FSDP2 shards each block).

What a model contributes is data, not code: the :class:`ParallelizePlan` names its block types
and output head, and its layers carry the hooks above (``check_tp``, ``set_tensor_parallel``,
``set_context_parallel``, ``shared_input_linears``, ``recompute_target``), so a new model family
reuses this function unchanged. Pipeline parallelism cuts the model into chunks first and runs
this function on each (:func:`mt_parallel.pipeline.pipeline_chunks`). Expert parallelism is
part of step 1: after the TP cut, :func:`mt_parallel.moe.apply_expert_parallel` keeps each ep
rank's routed experts (their gradients are reduced over the expert-data-parallel group, not by
DDP; under FSDP2 step 6 shards them over that group, ZeRO-1 shards their optimizer state there)
and gives the routers the dp×cp group for the aux-loss-free token counts. FP8 (step 3)
also runs the experts' grouped linears through ``mt_fp8.FP8GroupedLinear``, with the formats
:func:`expert_recipe` picks (E4M3 gradients under per-row or finer scales, so the grouped GEMM
keeps its single launch in the backward).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from mt_comm import ParallelState
from mt_fp8 import FP8_GEMMS, TENSORWISE, FormatConfig, TensorRole
from mt_parallel.config import ParallelConfig
from mt_parallel.data_parallel import apply_data_parallel, set_fp8_weight_cache
from mt_parallel.layers import TensorParallelModule, _ParallelLinear
from mt_parallel.mappings import group_size
from mt_parallel.moe.layer import apply_expert_parallel
from mt_parallel.recompute import apply_recompute

if TYPE_CHECKING:
    from mt_parallel.pipeline.split import PipelineLayout


@dataclass(frozen=True)
class ParallelizePlan:
    """What :func:`parallelize` needs to know about a model (module docstring)."""

    block_types: tuple[type[nn.Module], ...]
    """The repeated units: each is recomputed whole (``recompute=full``), compiled and sharded
    by FSDP2 on its own."""
    output_head: str | None = None
    """Qualified name of the output (logits) linear: high precision unless
    :attr:`FP8Options.output_head`, which then runs :attr:`FP8Options.output_head_gemms`."""
    fp8_skip: tuple[str, ...] = ()
    """Module-name fragments whose TP linears always stay in high precision (a router, say)."""
    sequence_parallel_skip: tuple[str, ...] = ()
    """Module-name fragments whose TP layers (and ``set_tensor_parallel`` hooks) stay plain TP
    when sequence parallel is on: their inputs are replicated over the TP group, not sequence
    shards (a vision encoder, whose image tokens are not the decoder's sequence)."""
    pipeline: PipelineLayout | None = None
    """Where the embedding, blocks and final modules are, for pipeline parallelism (None: the
    model cannot be pipelined)."""


@dataclass(frozen=True)
class FP8Options:
    """Which linears run in FP8 and how (step 3 of the module docstring)."""

    recipe: Any
    """An ``mt_fp8`` recipe (``mt_fp8.recipe_from_name``)."""
    backend: str = "auto"
    """mt_fp8 GEMM backend: auto, fast, scaled_mm, triton or emulate."""
    gemms: tuple[str, ...] = FP8_GEMMS
    """Which GEMMs of the blocks' linears (``forward``, ``dgrad``, ``wgrad``) run in FP8."""
    min_features: int = 0
    """Linears whose smaller side is below this stay high precision (FP8 pays on large GEMMs)."""
    output_head: bool = False
    """Run the plan's output head in FP8 too."""
    output_head_gemms: tuple[str, ...] = FP8_GEMMS
    """With ``output_head``: which of the head's GEMMs run in FP8."""
    cache_weight: bool = True
    """Keep each layer's FP8 weight from its first forward of a step to its last backward."""
    expert_formats: str = "auto"
    """FP8 formats of the MoE experts' grouped GEMMs (:func:`expert_recipe`): ``auto``,
    ``e4m3`` or ``recipe``."""

    def __post_init__(self) -> None:
        if self.expert_formats not in EXPERT_FORMATS:
            raise ValueError(
                f"expert_formats={self.expert_formats!r} is unknown; valid: {', '.join(EXPERT_FORMATS)}"
            )


EXPERT_FORMATS = ("auto", "e4m3", "recipe")
"""Choices of :attr:`FP8Options.expert_formats`."""


def expert_recipe(recipe: Any, expert_formats: str = "auto") -> Any:
    """The recipe the MoE experts' grouped GEMMs run with.

    PyTorch's grouped FP8 GEMM (``torch._scaled_grouped_mm``) takes E4M3 operands only, so an
    E5M2 gradient (the hybrid formats most recipes default to) makes ``FP8GroupedLinear`` run
    the backward as one GEMM per expert. ``e4m3`` switches every role to E4M3; ``recipe`` keeps
    the recipe's formats; ``auto`` is ``e4m3`` where the recipe scales gradients per row or
    finer (rowwise, block, MXFP8: each scale covers one row's range, which E4M3 holds, as
    torchao's rowwise recipe and DeepSeek-V3 train) and ``recipe`` for per-tensor scales
    (tensorwise, delayed), whose single gradient scale needs E5M2's range.
    """
    if expert_formats not in EXPERT_FORMATS:
        raise ValueError(
            f"expert_formats={expert_formats!r} is unknown; valid: {', '.join(EXPERT_FORMATS)}"
        )
    if recipe is None or expert_formats == "recipe":
        return recipe
    if expert_formats == "auto" and recipe.layout(TensorRole.GRAD_OUTPUT) == TENSORWISE:
        return recipe
    return replace(recipe, formats=FormatConfig.all_e4m3())


def apply_tensor_parallel(
    model: nn.Module,
    tp_group: Any,
    sequence_parallel: bool = False,
    sequence_parallel_skip: tuple[str, ...] = (),
) -> nn.Module:
    """Shard ``model``'s TP layers over ``tp_group`` in place (step 1 of the module docstring);
    modules whose name contains an entry of ``sequence_parallel_skip`` keep SP off."""
    tp = group_size(tp_group)
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallel needs tensor parallelism (a tp group of > 1 rank)")
    if tp == 1:
        return model
    for module in model.modules():
        check = getattr(module, "check_tp", None)
        if check is not None:
            check(tp)
    for name, module in model.named_modules():
        sp = sequence_parallel and not any(skip in name for skip in sequence_parallel_skip)
        if isinstance(module, TensorParallelModule):
            module.shard_(tp_group, sp)
        elif hasattr(module, "set_tensor_parallel"):
            module.set_tensor_parallel(tp_group, sp)
    return model


def apply_context_parallel(model: nn.Module, cp_group: Any, ring: bool = False) -> nn.Module:
    """Make every module with a ``set_context_parallel`` hook (the attention cores) attend over
    the sequence split across ``cp_group``, by all-gathering K/V or (``ring``) with
    :func:`mt_parallel.ring_attention` (a core refuses the ring when it has dropout)."""
    for module in model.modules():
        if hasattr(module, "set_context_parallel"):
            module.set_context_parallel(cp_group, ring)
    return model


def apply_fp8(
    model: nn.Module,
    recipe: Any = None,
    amax_group: Any = None,
    skip: tuple[str, ...] = (),
    expert_formats: str = "auto",
    **fp8_kwargs: Any,
) -> nn.Module:
    """Run every TP linear (except names containing an entry of ``skip``) in FP8.

    ``recipe`` is an ``mt_fp8`` recipe (default: mt-fp8's default; the MoE experts take
    :func:`expert_recipe` of it with ``expert_formats``); ``amax_group`` (usually
    the TP group) is where ``mt_fp8.update_fp8_scales`` MAX-reduces delayed-scaling amaxes and
    current tensorwise scaling the amaxes of each layer's ``fp8_sharded_roles``. The FP8
    layers of each module's ``shared_input_linears()`` get tied input scales (module docstring).
    """
    from mt_fp8 import tie_input_scales
    from mt_parallel.moe.experts import GroupedLinear

    experts = expert_recipe(recipe, expert_formats)
    for name, module in model.named_modules():
        if isinstance(module, GroupedLinear) and not any(s in name for s in skip):
            module.enable_fp8(experts, **fp8_kwargs)
        elif isinstance(module, _ParallelLinear) and not any(s in name for s in skip):
            module.enable_fp8(recipe, **fp8_kwargs)
            if amax_group is not None and group_size(amax_group) > 1:
                module.fp8_meta.amax_group = amax_group
    for module in model.modules():
        if hasattr(module, "shared_input_linears"):
            readers = [linear for linear in module.shared_input_linears() if linear.fp8_enabled]
            tie_input_scales([linear.fp8_meta for linear in readers])
    return model


def high_precision_linears(
    model: nn.Module, plan: ParallelizePlan, fp8: FP8Options
) -> tuple[str, ...]:
    """Names of the TP linears (and MoE expert projections) that stay high precision: the
    plan's ``fp8_skip``, the output head (unless ``fp8.output_head``), the layers below
    ``fp8.min_features`` and those whose local dims the recipe cannot run (FP8 GEMMs need both
    dims divisible by 16 and by the recipe's block, ``mt_fp8.linear_plan.check_dims``; e.g.
    DeepSeek-V3's 576-wide ``kv_a_proj`` under 128×128 blocks). The last are named in one
    warning, as ``mt_fp8.convert_to_fp8`` skips such layers."""
    from mt_fp8 import TensorwiseScaling
    from mt_fp8.linear_plan import check_dims, dims_multiple
    from mt_parallel.moe.experts import GroupedLinear

    skip = list(plan.fp8_skip)
    if plan.output_head is not None and not fp8.output_head:
        skip.append(plan.output_head)
    recipe = fp8.recipe if fp8.recipe is not None else TensorwiseScaling()
    unfit = []
    for name, module in model.named_modules():
        if isinstance(module, _ParallelLinear):
            out_features, in_features = module.weight.shape
        elif isinstance(module, GroupedLinear):
            out_features, in_features = module.weight.shape[1:]  # [experts, out, in]
        else:
            continue
        if name in skip:
            continue
        if min(out_features, in_features) < fp8.min_features:
            skip.append(name)
        elif check_dims(recipe, in_features, out_features) is not None:
            skip.append(name)
            unfit.append(f"{name} ({in_features}->{out_features})")
    if unfit:
        warnings.warn(
            f"{len(unfit)} linear(s) stay high precision: FP8 GEMMs with the {recipe.name} "
            f"recipe need both local dims divisible by {dims_multiple(recipe)}: "
            f"{', '.join(unfit)}",
            stacklevel=2,
        )
    return tuple(skip)


def apply_fp8_options(
    model: nn.Module, plan: ParallelizePlan, fp8: FP8Options, amax_group: Any = None
) -> nn.Module:
    """Run ``model``'s TP linears in FP8 as ``fp8`` says (:func:`apply_fp8`): the blocks' with
    the GEMMs of ``fp8.gemms``, the plan's output head (with ``fp8.output_head``) with those of
    ``fp8.output_head_gemms``, the :func:`high_precision_linears` not at all."""
    skip = high_precision_linears(model, plan, fp8)
    head = plan.output_head
    apply_fp8(
        model,
        fp8.recipe,
        amax_group=amax_group,
        skip=skip if head is None else (*skip, head),
        expert_formats=fp8.expert_formats,
        backend=fp8.backend,
        fp8_gemms=tuple(fp8.gemms),
    )
    if head is not None and head not in skip:
        apply_fp8(
            model.get_submodule(head),
            fp8.recipe,
            amax_group=amax_group,
            backend=fp8.backend,
            fp8_gemms=tuple(fp8.output_head_gemms),
        )
    return model


def parallelize(
    model: nn.Module,
    config: ParallelConfig,
    state: ParallelState,
    plan: ParallelizePlan,
    fp8: FP8Options | None = None,
    data_parallel: str | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply TP/SP → CP → FP8 (if ``fp8``) → recompute → compile → DP, in that order.

    ``state`` is ``mt_comm``'s parallel state with the same degrees as ``config``; ``plan``
    names the model's blocks and output head. Returns the model to train (a DDP wrapper in
    ``ddp`` mode when dp×cp > 1, else ``model`` itself). ``data_parallel`` overrides
    ``config.data_parallel`` for the last step (pipeline chunks: ``fsdp`` or ``none``, where the
    caller reduces); ``reshard_after_forward`` is FSDP2's (``fsdp`` only).
    """
    config.validate_world(state.dims.world_size)
    for dim in ("tp", "cp", "pp", "ep"):
        if state.size(dim) != getattr(config, dim):
            raise ValueError(
                f"parallel.{dim}={getattr(config, dim)} but the parallel state has "
                f"{dim}={state.size(dim)}"
            )
    tp_group = state.group("tp")
    apply_tensor_parallel(model, tp_group, config.sequence_parallel, plan.sequence_parallel_skip)
    apply_expert_parallel(model, state.group("ep"), state.group("edp"), state.group("dp_cp"))
    if config.cp > 1:
        apply_context_parallel(model, state.group("cp"), config.cp_attention == "ring")
    if fp8 is not None:
        apply_fp8_options(model, plan, fp8, amax_group=tp_group)
        set_fp8_weight_cache(model, fp8.cache_weight)
    apply_recompute(
        model,
        config.recompute,
        config.recompute_every,
        config.recompute_targets,
        plan.block_types,
        config.recompute_keep,
    )
    if config.compile:
        for module in model.modules():
            if isinstance(module, plan.block_types):
                module.compile()
    return apply_data_parallel(
        model, data_parallel or config.data_parallel, state.group("dp_cp"), state.device_type,
        plan.block_types, reshard_after_forward,
    )  # fmt: skip
