"""FP8 layers: :class:`FP8Linear` (a drop-in ``nn.Linear``) and :class:`FP8GroupedLinear` (MoE).

Both run :class:`~mt_fp8.functional.FP8LinearFunction` (quantized forward and backward GEMMs,
FP8-saved input, cached FP8 weight; ``FP8GroupedLinear`` once per expert); see
:mod:`mt_fp8.functional` for the math and :mod:`mt_fp8.linear_plan` for the quantizers. Where a
grouped FP8 GEMM can take them (PyTorch's for tensorwise and rowwise scales, mt-fp8's Triton
kernels for block scaling and MXFP8), ``FP8GroupedLinear`` runs all experts at once instead,
with the same FP8 operands (:mod:`mt_fp8.grouped`, :mod:`mt_fp8.grouped_block`). Parameters
keep their dtype (fp32 or bf16); the output dtype is the ``torch.autocast`` dtype inside an
autocast region and the input's dtype otherwise. ``fp8_autocast`` (:mod:`mt_fp8.autocast`) can
switch a region to high precision or override the recipe.

Under tensor parallelism, ``FP8Linear(amax_reduction_roles=...)`` names the roles whose current
tensorwise amax is MAX-reduced over the layer's amax group (``fp8_meta.amax_group``, set by
``fp8_autocast(amax_group=...)`` or by the caller); see :mod:`mt_fp8.linear_plan`. The default is
all three roles, which is always correct (replicated tensors reduce to their own amax); a
parallel layer can list only the roles it shards to save collectives. ``FP8GroupedLinear``
never reduces: experts with no tokens skip their GEMMs, so the ranks' all-reduces would not
line up.

Weight cache: ``cache_weight`` (default True) keeps the FP8 weight across the micro-batches of
one optimizer step in the layer's :class:`~mt_fp8.weight_cache.WeightCache` (``fp8_weight_cache``;
``FP8GroupedLinear``: ``expert_weight_caches`` and ``grouped_weight_cache``). Any torch
optimizer's step invalidates it, through a global optimizer step post-hook that creating the
first FP8 layer installs (:func:`mt_fp8.weight_cache.install_optimizer_step_hook`; importing
:mod:`mt_fp8` registers nothing); after other in-place writes that do not bump the weight's
version, call :func:`clear_fp8_weight_caches`. Set it False when something else re-materialises
the weight without bumping its version counter, as FSDP2 does when it all-gathers the unsharded
parameter: the cache key (storage pointer, ``_version``) could then match a new all-gather on one
rank and not on its TP peer (whose weight-amax all-reduce would wait alone), or match stale
weights. ``mt_parallel.apply_data_parallel(mode="fsdp")`` turns it off.

torch.compile: both layers' ``forward`` run eagerly inside compiled models (a graph break on
either side; Dynamo compiles the code around them). Their quantizers and GEMMs are fused kernels
already, so compiling through them gains little, and compiled through they trained wrongly.
NOTE: seen with torch 2.11 on the H200: decoder blocks compiled with ``FP8Linear`` traced in
gave all-zero weight gradients for every block parameter (the loss agreed with eager); with
``forward`` kept eager their gradients match eager's. On the CPU both ways matched; the cause
inside the compiler stack was not isolated.

Shape suffixes: T tokens (all groups), E groups (experts), K in_features, N out_features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mt_fp8.autocast import current_fp8_state
from mt_fp8.formats import TensorRole
from mt_fp8.functional import fp8_linear, fp8_swiglu_linear
from mt_fp8.gemm import BACKENDS
from mt_fp8.grouped import (
    check_group_sizes,
    fp8_grouped_linear,
    grouped_gemm_reason,
    host_group_sizes,
    reads_sizes_on_device,
)
from mt_fp8.grouped_block import fp8_block_grouped_linear
from mt_fp8.linear_plan import FP8_GEMMS, LinearPlan, check_dims, parse_fp8_gemms
from mt_fp8.ops.dispatch import compiler_disable
from mt_fp8.ops.swiglu import swiglu
from mt_fp8.recipes import BlockScaling, MXFP8Scaling, Recipe, TensorwiseScaling
from mt_fp8.state import FP8Meta
from mt_fp8.weight_cache import WeightCache
from mt_fp8.wgrad import WeightGradSink


class _FP8LayerMixin:
    """Recipe resolution and plan building shared by the FP8 layers."""

    recipe: Recipe
    backend: str
    track_health: bool
    fp8_meta: FP8Meta
    amax_reduction_roles: frozenset[TensorRole]
    cache_weight: bool = True
    """Reuse the FP8 weight while the weight is unchanged (module docstring: weight cache)."""
    fp8_gemms: frozenset[str] = frozenset(FP8_GEMMS)
    """The GEMMs that run in FP8 (:mod:`mt_fp8.functional`: per-GEMM precision)."""
    wgrad_sink: WeightGradSink | None = None
    """Set: the backward queues the weight (and bias) gradient here instead of computing it
    (:mod:`mt_fp8.wgrad`; zero-bubble pipeline schedules run it as their ``W`` step)."""

    def _init_fp8(
        self,
        recipe: Recipe | None,
        backend: str,
        track_health: bool,
        amax_reduction_roles: Iterable[TensorRole | str] = (),
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown FP8 GEMM backend {backend!r}; valid: {', '.join(BACKENDS)}")
        self.recipe = recipe if recipe is not None else TensorwiseScaling()
        if not isinstance(self.recipe, Recipe):
            raise TypeError(f"recipe must be an mt_fp8 Recipe, got {recipe!r}")
        self.backend = backend
        self.track_health = track_health
        self.amax_reduction_roles = _parse_roles(amax_reduction_roles)

    def linear_plan(self, x: torch.Tensor, weight_cache: WeightCache | None) -> LinearPlan | None:
        """The plan of a call on ``x`` that keeps its FP8 weight in ``weight_cache`` (None:
        quantize it afresh), or None when an ``fp8_autocast(enabled=False)`` region is active.
        Also records the autocast region's amax group on ``fp8_meta``, as a call does."""
        state = current_fp8_state()
        if state is not None and not state.enabled:
            return None
        recipe = state.recipe if state is not None and state.recipe is not None else self.recipe
        if state is not None and state.amax_group is not None:
            self.fp8_meta.amax_group = state.amax_group
        self.fp8_meta.ensure_delayed(recipe)
        self.fp8_meta.input_meta.ensure_delayed(recipe)
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        return LinearPlan(
            recipe,
            self.fp8_meta,
            self.backend,
            out_dtype,
            self.track_health,
            weight_cache if self.cache_weight else None,
            amax_group=self.fp8_meta.amax_group,
            amax_reduction_roles=self.amax_reduction_roles,
            fp8_gemms=self.fp8_gemms,
            wgrad_sink=self.wgrad_sink,
        )


def _parse_roles(roles: Iterable[TensorRole | str]) -> frozenset[TensorRole]:
    if isinstance(roles, (str, TensorRole)):
        roles = (roles,)
    parsed = set()
    for role in roles:
        if isinstance(role, TensorRole):
            parsed.add(role)
            continue
        try:
            parsed.add(TensorRole[str(role).upper()])
        except KeyError:
            valid = ", ".join(repr(r.name.lower()) for r in TensorRole)
            raise ValueError(f"unknown tensor role {role!r}; valid roles: {valid}") from None
    return frozenset(parsed)


class FP8Linear(_FP8LayerMixin, nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 with ``recipe`` (default: tensorwise scaling).

    ``backend``: ``"auto"`` (fast path where possible, else emulation), ``"fast"`` (error
    instead of emulating), ``"scaled_mm"``, ``"bf16"`` (exact for MX scales), ``"triton"`` or
    ``"emulate"`` (:mod:`mt_fp8.gemm`). ``track_health``
    counts saturated and flushed values per role (:func:`mt_fp8.fp8_health`).
    ``amax_reduction_roles`` (``TensorRole`` s or their names, default all three): roles whose
    current tensorwise amax is MAX-reduced over ``fp8_meta.amax_group`` when one is set.
    ``fp8_gemms`` (default all three): which of ``forward``, ``dgrad``, ``wgrad`` run in FP8;
    the others run in the autocast dtype from high-precision operands (:mod:`mt_fp8.functional`:
    per-GEMM precision), e.g. ``("forward", "dgrad")`` keeps the weight gradient's GEMM exact.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        recipe: Recipe | None = None,
        backend: str = "auto",
        track_health: bool = True,
        amax_reduction_roles: Iterable[TensorRole | str] = tuple(TensorRole),
        fp8_gemms: Iterable[str] = FP8_GEMMS,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe, backend, track_health, amax_reduction_roles)
        self.fp8_gemms = parse_fp8_gemms(fp8_gemms)
        reason = check_dims(self.recipe, in_features, out_features)
        if reason is not None:
            raise ValueError(f"FP8Linear: {reason}")
        self.fp8_meta = FP8Meta(self.recipe, device=self.weight.device)
        self._weight_cache = WeightCache()

    @property
    def fp8_weight_cache(self) -> WeightCache:
        """The cached FP8 weight (module docstring: weight cache); read-only for callers."""
        return self._weight_cache

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: Recipe | None = None, **kwargs: object
    ) -> FP8Linear:
        """An FP8Linear sharing ``linear``'s parameters (same objects: optimizers stay valid)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            recipe=recipe,
            **kwargs,  # type: ignore[arg-type]
        )
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.fp8_meta = FP8Meta(layer.recipe, device=linear.weight.device)
        return layer

    @compiler_disable  # eager inside compiled models (module docstring)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.linear_plan(x, self._weight_cache)
        if plan is None:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, plan)

    @compiler_disable  # eager inside compiled models (module docstring)
    def forward_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``self(swiglu(gate, up))``, the down projection of a SwiGLU MLP, without storing
        ``swiglu(gate, up)`` in high precision where the fused quantizer applies
        (:mod:`mt_fp8.functional`: SwiGLU into FP8). Same outputs and gradients."""
        plan = self.linear_plan(gate, self._weight_cache)
        if plan is None:
            return F.linear(swiglu(gate, up), self.weight, self.bias)
        return fp8_swiglu_linear(gate, up, self.weight, self.bias, plan)

    def extra_repr(self) -> str:
        gemms = (
            "" if len(self.fp8_gemms) == len(FP8_GEMMS) else f", fp8_gemms={sorted(self.fp8_gemms)}"
        )
        return f"{super().extra_repr()}, recipe={self.recipe.name}, backend={self.backend}{gemms}"


class FP8GroupedLinear(_FP8LayerMixin, nn.Module):
    """``E`` weight matrices applied to ``E`` contiguous token groups in one call (MoE experts).

    ``forward(x_TK, group_sizes)`` takes tokens sorted by group and ``group_sizes`` (E ints
    summing to T, or an int32/int64 tensor of them) and returns ``y_TN`` with
    ``y[group e] = x[group e] · weight[e]ᵀ + bias[e]``. A tensor on the tokens' device is read
    there by the grouped block-scaled and MXFP8 path and by the rowwise grouped path with every
    GEMM grouped (all-E4M3 formats): no device-to-host read, so the host queues the call
    without waiting for the kernels that computed the sizes (:meth:`reads_sizes_on_device`).
    The other paths (tensorwise, rowwise with per-expert GEMMs, the loop) need host ints and
    read it to the host first, which waits for the device.

    Two implementations with the same FP8 operands (same bytes, same scales):

    * Grouped (:mod:`mt_fp8.grouped`), with ``backend`` ``"auto"`` or ``"fast"``
      (:func:`~mt_fp8.grouped.grouped_gemm_reason` says why not otherwise):

      - current tensorwise or rowwise scaling on CUDA compute capability 9.x: one
        ``torch._scaled_grouped_mm`` per GEMM for all experts. The kernel takes E4M3 operands
        only, so with the default hybrid formats the forward GEMM is grouped and dgrad/wgrad
        (E5M2 gradients) run per expert;
      - block scaling (1×128 groups, 128×128 blocks) and MXFP8 (1×32 groups) on CUDA compute
        capability >= 9.0 with Triton: all three GEMMs in mt-fp8's grouped block-scaled Triton
        kernels (:mod:`mt_fp8.grouped_block`), any formats.

      One cached entry holds all experts' FP8 weights, stacked.
    * Loop: one FP8 GEMM per non-empty group (every other recipe, device and backend), with one
      shared delayed-scaling state (amax = max over experts) and one cached FP8 weight per
      expert.

    ``wgrad_sink`` (zero-bubble pipelines, :mod:`mt_fp8.wgrad`): the grouped path queues its
    weight-gradient GEMMs (and the bias gradient) there, as ``FP8Linear`` does, where the call
    multiplies by ``self.weight`` itself; the loop, and a call given a view of the weight (whose
    gradient autograd must carry back, e.g. summed over TP), compute them in the backward.
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        recipe: Recipe | None = None,
        backend: str = "auto",
        track_health: bool = True,
    ) -> None:
        super().__init__()
        if num_groups < 1:
            raise ValueError(f"FP8GroupedLinear needs num_groups >= 1, got {num_groups}")
        self._init_fp8(recipe, backend, track_health)
        reason = check_dims(self.recipe, in_features, out_features)
        if reason is not None:
            raise ValueError(f"FP8GroupedLinear: {reason}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory)) if bias else None
        self.fp8_meta = FP8Meta(self.recipe, device=self.weight.device)
        self._weight_caches = tuple(WeightCache() for _ in range(num_groups))
        self._grouped_weight_cache = WeightCache()
        self.reset_parameters()

    @property
    def defers_weight_gradient(self) -> bool:
        """Whether a ``wgrad_sink`` set here gets the gradient of calls on ``self.weight``:
        whether they take the grouped path (class docstring), judged from the layer's recipe,
        backend, device and shape for bf16 outputs and tokens on every expert (a call under
        another recipe or output dtype may loop, and the loop computes it in the backward)."""
        experts, weight = self.num_groups, self.weight
        x_TK = weight.new_empty(experts + 1, self.in_features)
        sizes = [2] + [1] * (experts - 1)
        reason = grouped_gemm_reason(x_TK, weight, sizes, self.recipe, self.backend, torch.bfloat16)
        return reason is None

    def reads_sizes_on_device(self, x_TK: torch.Tensor) -> bool:
        """Whether a call on ``x_TK`` reads a tensor of group sizes on the device rather than
        reading it to the host first (class docstring), judged from the recipe in force (an
        ``fp8_autocast`` override included), the backend, the device and the shapes
        (:func:`mt_fp8.grouped.reads_sizes_on_device`)."""
        state = current_fp8_state()
        if state is not None and not state.enabled:
            return False
        recipe = state.recipe if state is not None and state.recipe is not None else self.recipe
        return reads_sizes_on_device(x_TK, self.weight, recipe, self.backend)

    @property
    def expert_weight_caches(self) -> tuple[WeightCache, ...]:
        """Each expert's cached FP8 weight, for the per-expert loop (class docstring)."""
        return self._weight_caches

    @property
    def grouped_weight_cache(self) -> WeightCache:
        """All experts' cached FP8 weights, stacked, for the grouped path (class docstring)."""
        return self._grouped_weight_cache

    def reset_parameters(self) -> None:
        for expert in range(self.num_groups):
            nn.init.kaiming_uniform_(self.weight[expert], a=5**0.5)
        if self.bias is not None:
            bound = 1 / self.in_features**0.5
            nn.init.uniform_(self.bias, -bound, bound)

    @compiler_disable  # eager inside compiled models (module docstring)
    def forward(
        self,
        x_TK: torch.Tensor,
        group_sizes: Sequence[int] | torch.Tensor,
        weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``weight``: the ``[E, N, K]`` tensor to multiply by instead of ``self.weight``, a
        differentiable view of it (mt-parallel's sequence-parallel experts pass one whose
        gradient is summed over the TP group); its FP8 copies are cached under the parameter
        the view belongs to (``weight_cache.weight_owner``)."""
        weight = self.weight if weight is None else weight
        on_host = torch.is_tensor(group_sizes) and group_sizes.device.type == "cpu"
        if on_host and group_sizes.device != x_TK.device:  # reading it waits for nothing
            group_sizes = group_sizes.tolist()
        sizes = check_group_sizes(group_sizes, self.num_groups, x_TK)
        plan = self.linear_plan(x_TK, self._grouped_weight_cache)
        if plan is not None:
            if weight is not self.weight:  # a view's gradient must pass through autograd
                plan = dataclasses.replace(plan, wgrad_sink=None)
            # Reads no sizes; the grouped paths read device sizes where they lie, or to the host
            # where they need host ints (class docstring).
            reason = grouped_gemm_reason(
                x_TK, weight, sizes, plan.recipe, self.backend, plan.out_dtype
            )
            if reason is None and isinstance(plan.recipe, (BlockScaling, MXFP8Scaling)):
                return fp8_block_grouped_linear(x_TK, weight, self.bias, sizes, plan)
            if reason is None:
                return fp8_grouped_linear(x_TK, weight, self.bias, sizes, plan)
        sizes = host_group_sizes(sizes, self.num_groups, x_TK)
        outputs = []
        # NOTE: one unbind, not E indexings: each ``weight[e]``'s backward is a zero tensor of the
        # whole [E, N, K] shape plus an add, E² work; unbind's backward stacks the E gradients.
        weights = weight.unbind(0)
        biases = [None] * self.num_groups if self.bias is None else self.bias.unbind(0)
        for expert, x_e in enumerate(torch.split(x_TK, sizes)):
            if x_e.shape[0] == 0:
                outputs.append(x_e.new_empty(0, self.out_features))
                continue
            bias = biases[expert]
            plan = self.linear_plan(x_e, self._weight_caches[expert])
            if plan is None:
                outputs.append(F.linear(x_e, weights[expert], bias))
            else:
                # NOTE: an expert's weight is a view of the stacked parameter, whose ``.grad`` a
                # deferred weight gradient cannot reach: the loop computes it in the backward
                # (as the grouped path does), never in a ``wgrad_sink``.
                plan = dataclasses.replace(plan, wgrad_sink=None)
                outputs.append(fp8_linear(x_e, weights[expert], bias, plan))
        return torch.cat(outputs)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, recipe={self.recipe.name}"
        )


def clear_fp8_weight_caches(model: nn.Module) -> None:
    """Drop every cached FP8 weight in ``model`` (after writing weights outside a torch optimizer).

    The caches key on the weight's ``_version`` and on the count of torch optimizer steps;
    ``p.data.copy_(...)`` changes neither; see :mod:`mt_fp8.weight_cache`.
    """
    for module in model.modules():
        if isinstance(module, FP8Linear):
            module.fp8_weight_cache.clear()
        elif isinstance(module, FP8GroupedLinear):
            for cache in module.expert_weight_caches:
                cache.clear()
            module.grouped_weight_cache.clear()
