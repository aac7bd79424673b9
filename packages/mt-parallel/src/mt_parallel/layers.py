"""Megatron-style tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Shape suffixes: B batch, T sequence (the local shard T/tp under sequence parallel), K input
features, N output features, V vocabulary; ``_l`` marks the local TP slice (``N_l = N / tp``).
Activations are batch-first ``x_BTK``; the sequence dimension is 1.

Math over a TP group of size ``p`` (rank ``r``), ``y = x Wᵀ + b`` with ``W`` of shape ``(N, K)``:

* Column parallel: rank ``r`` holds rows ``W[r·N_l:(r+1)·N_l]`` (and that slice of ``b``) and
  computes ``y_l = x W_lᵀ + b_l``, its slice of the output features. The input must be the full
  ``x`` on every rank: without SP the input is already replicated and its gradient is summed over
  the group (:func:`copy_to_group`); with SP the input is the sequence shard and is all-gathered
  along T first (backward: reduce-scatter). ``gather_output`` all-gathers ``y`` along N.
* Row parallel: rank ``r`` holds columns ``W[:, r·K_l:(r+1)·K_l]`` and computes the partial sum
  ``x_l W_lᵀ``; the partials are summed over the group (all-reduce, or reduce-scatter along T
  under SP) and the replicated ``b`` is added after the sum. ``input_is_parallel=False`` slices a
  replicated input first.
* Vocab-parallel embedding: rank ``r`` holds rows ``[r·V_l, (r+1)·V_l)`` of the table; ids outside
  the range look up zeros, and the partial embeddings are summed (all-reduce, or reduce-scatter
  along T under SP).

Invariants: every parameter is either sharded along the dimension in ``tp_shard_dims`` (and marked
``param.tensor_parallel = True``) or replicated and identical on every TP rank. Replicated
parameters used on a sequence shard (the row-parallel bias under SP) get their gradient summed
over the group in backward, so replicated gradients stay identical across TP ranks.

Initialisation never depends on the TP degree: :meth:`reset_parameters` draws the *full* matrix
(from ``generator`` or the global RNG) and keeps this rank's slice, so a model at tp=1 and at tp=4
starts from the same full weights. :meth:`shard_` turns a layer built at tp=1 into this rank's
shard (the tensor-parallel transform). FP8: :meth:`enable_fp8` routes the local GEMM through
``mt_fp8.FP8Linear`` (sharing this layer's parameters). With an amax group (the TP group, set
by :func:`mt_parallel.apply_fp8`), current tensorwise scaling MAX-reduces the amax of each
tensor that is a TP shard, so every rank quantizes its shard with the whole tensor's scale
(the result is the tp=1 FP8 result up to summation order). Which tensors are shards
(``fp8_sharded_roles``): column parallel, the weight and the output gradient (its input is
replicated or all-gathered); row parallel, the input and the weight (its output gradient is
replicated or all-gathered). Replicated tensors would reduce to their own amax, so they skip
the collective.

FP8 under ``torch.compile``: ``mt_fp8.FP8Linear`` runs eagerly behind a graph break (its
module docstring says why), and the code after a break inside a nested call becomes a compiled
graph of its own, with its own guards and autograd node. So the FP8 paths run the whole local
layer eagerly in one ``torch.compiler.disable`` region: the GEMM with the column-parallel bias
(``_fp8_gemm``), and for row parallel also the reduction and bias (``_fp8_forward``). A biased
FP8 linear then splits a compiled block into as many graphs as an unbiased one; with the bias
add after the break, every biased linear of a CLIP encoder block had added a one-op graph (its
forward and backward each a separate compiled call), and the encoder was launch-bound.

Deferred weight gradients (``wgrad_sink``, an ``mt_fp8.WeightGradSink``; None by default): the
zero-bubble pipeline schedules run a chunk's weight gradients as a separate ``W`` step
(:mod:`mt_parallel.pipeline.runtime` sets the sink). In FP8 the sink is the FP8 layer's. Without
FP8 the local GEMM ``y = x W_lᵀ (+ b_l)`` then runs through :class:`_DeferredWeightGradLinear`,
whose backward returns ``dx = dy W_l`` and queues ``dW_l = dyᵀ x`` and ``db_l = Σ dy`` in the
sink, accumulated into ``weight.grad``/``bias.grad`` when the sink's work runs. It replays what
autograd does for ``F.linear`` under the ambient autocast: the same casts (floating operands other
than float64 to the autocast dtype), the same forward call, the same backward GEMMs on the same
operands (``x`` and ``dy`` flattened to 2-D, ``mm``), the gradients cast back to each parameter's
dtype and added as autograd's accumulation does; so the gradients equal the plain path's bit for
bit. From ``I`` to ``W`` the queue holds each GEMM's ``x`` (saved for the backward anyway)
and ``dy``. The tensor-parallel communication wraps the GEMM's input and output (``prepare_input``,
:meth:`RowParallelLinear._reduce`), never its operands, so it is the same on both paths.
Exception: a weight read twice in one autocast forward gets its two bf16 gradients summed before
the cast by autograd, in fp32 after it here (no layer here reads its weight twice). The deferred
GEMM runs eagerly (``torch.compiler.disable``: its backward queues Python work).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mt_fp8.ops import swiglu
from mt_fp8.wgrad import WeightGradSink, accumulate_grad
from mt_parallel.mappings import (
    all_gather_grad_rs,
    copy_to_group,
    gather_from_group,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter_grad_ag,
    scatter_to_group,
)

SEQUENCE_DIM = 1
DEFAULT_INIT_STD = 0.02


class TensorParallelModule(nn.Module):
    """Base of the TP layers: group bookkeeping, TP-independent init, sharding (module doc)."""

    tp_shard_dims: ClassVar[dict[str, int]] = {}
    """Parameter name -> dimension split over the TP group; parameters not listed are replicated."""
    tp_shard_labels: ClassVar[dict[str, str]] = {}
    """Parameter name -> what its split dimension is called in error messages."""

    def _setup_tp(self, tp_group: Any, sequence_parallel: bool) -> None:
        if sequence_parallel and group_size(tp_group) == 1:
            raise ValueError(
                f"{type(self).__name__}: sequence_parallel=True needs a tensor-parallel group of "
                "more than one rank"
            )
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel

    @property
    def tp_size(self) -> int:
        return group_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp_group)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's full (tp=1) shape."""
        raise NotImplementedError

    def _init_full(self, name: str, full: torch.Tensor, generator: torch.Generator | None) -> None:
        raise NotImplementedError

    def _check_divisible(self, tp: int) -> None:
        shapes = self.full_shapes()
        for name, dim in self.tp_shard_dims.items():
            if name not in shapes:
                continue
            size = shapes[name][dim]
            if size % tp:
                label = self.tp_shard_labels.get(name, f"{name} dimension {dim}")
                raise ValueError(
                    f"{type(self).__name__}: tensor parallel size tp={tp} does not divide "
                    f"{label}={size}"
                )

    def _local(self, name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        dim = self.tp_shard_dims.get(name)
        return full if dim is None else full.chunk(tp, dim=dim)[rank]

    def _make_params(self, device: Any, dtype: torch.dtype | None) -> None:
        self._check_divisible(self.tp_size)
        for name, shape in self.full_shapes().items():
            local = list(shape)
            if name in self.tp_shard_dims:
                local[self.tp_shard_dims[name]] //= self.tp_size
            self._set_param(name, torch.empty(local, device=device, dtype=dtype))

    def _set_param(self, name: str, data: torch.Tensor) -> None:
        # A replaced parameter (TP sharding) keeps the old one's requires_grad (frozen stays frozen).
        old = getattr(self, name, None)
        param = nn.Parameter(data, requires_grad=old.requires_grad if old is not None else True)
        if name in self.tp_shard_dims:
            param.tensor_parallel = True  # type: ignore[attr-defined]
        setattr(self, name, param)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw every full parameter (on the CPU when ``generator`` is given) and keep our slice."""
        for name, shape in self.full_shapes().items():
            param = getattr(self, name)
            full = torch.empty(shape, dtype=torch.float32)
            if generator is None:
                full = full.to(param.device)
            self._init_full(name, full, generator)
            param.copy_(self._local(name, full, self.tp_size, self.tp_rank))

    @torch.no_grad()
    def shard_(self, tp_group: Any, sequence_parallel: bool = False) -> None:
        """Keep this rank's slice of the full parameters (the layer must hold them, tp=1)."""
        if self.tp_size != 1:
            raise RuntimeError(f"{type(self).__name__} is already sharded over tp={self.tp_size}")
        tp, rank = group_size(tp_group), group_rank(tp_group)
        self._check_divisible(tp)
        for name in self.full_shapes():
            param = getattr(self, name)
            self._set_param(name, self._local(name, param.detach(), tp, rank).clone())
        self._setup_tp(tp_group, sequence_parallel)


def _init_linear(layer: TensorParallelModule, name: str, full: torch.Tensor, gen: Any) -> None:
    if name == "weight":
        full.normal_(0.0, layer.init_std, generator=gen)
    else:
        full.zero_()


def _autocast_operand(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` as autocast hands it to ``F.linear``: floating tensors other than float64 cast to
    the autocast ``dtype`` (None: autocast off, unchanged)."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


class _DeferredWeightGradLinear(torch.autograd.Function):
    """``F.linear(x, W, b)`` whose backward queues ``dW``/``db`` in a sink (module docstring:
    deferred weight gradients). ``dtype`` is the autocast dtype of the call (None: off); the
    function runs with autocast off and applies it itself."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype | None,
        sink: Any,
    ) -> torch.Tensor:
        x_c, weight_c = _autocast_operand(x, dtype), _autocast_operand(weight, dtype)
        y = F.linear(x_c, weight_c, _autocast_operand(bias, dtype))  # type: ignore[arg-type]
        ctx.save_for_backward(x_c, weight_c)
        ctx.params, ctx.sink, ctx.x_dtype = (weight, bias), sink, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # autograd's formulas for F.linear: addmm / mm on x and dy flattened to 2-D.
        x_c, weight_c = ctx.saved_tensors
        weight, bias = ctx.params
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy_MN = dy.reshape(-1, dy.shape[-1])
        dx = None
        if need_dx:
            dx = dy_MN.mm(weight_c).reshape(x_c.shape).to(ctx.x_dtype)
        if need_dw or need_db:
            x_MK = x_c.reshape(-1, x_c.shape[-1])

            def weight_gradients() -> None:
                if need_dw:
                    accumulate_grad(weight, dy_MN.t().mm(x_MK).to(weight.dtype))
                if need_db:
                    accumulate_grad(bias, dy_MN.sum(0).to(bias.dtype))

            ctx.sink.defer(weight_gradients, holds=(dy_MN, x_MK))
        return dx, None, None, None, None


@torch.compiler.disable  # the backward queues Python work (module docstring)
def _deferred_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sink: Any
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` under the ambient autocast, with ``dW``/``db`` queued in
    ``sink`` (module docstring: deferred weight gradients)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    with torch.autocast(device, enabled=False):
        return _DeferredWeightGradLinear.apply(x, weight, bias, dtype, sink)


class _ParallelLinear(TensorParallelModule):
    """Shared parts of the column- and row-parallel linears."""

    fp8_sharded_roles: ClassVar[tuple[str, ...]] = ()
    """FP8 tensor roles that are TP shards: their current-scaling amax is reduced over TP."""
    wgrad_sink: WeightGradSink | None = None
    """Set: the weight (and bias) gradient of the local GEMM is queued here (module docstring:
    deferred weight gradients); in FP8 the FP8 layer's own sink does it."""
    wgrad_sink_optional: ClassVar[bool] = True
    """torch's own split backward separates this layer's high-precision weight gradient too:
    the pipeline runtime sets the sink only where that split is wrong or the chunk has a sink
    anyway (:mod:`mt_parallel.pipeline.runtime`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp_group: Any,
        sequence_parallel: bool,
        init_std: float,
        device: Any,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_bias, self.init_std = bias, init_std
        self._setup_tp(tp_group, sequence_parallel)
        self._make_params(device, dtype)
        self._fp8: Any = None
        self.reset_parameters()

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"weight": (self.out_features, self.in_features)}
        if self.has_bias:
            shapes["bias"] = (self.out_features,)
        return shapes

    def _init_full(self, name: str, full: torch.Tensor, generator: Any) -> None:
        _init_linear(self, name, full, generator)

    def _gemm_bias(self) -> torch.Tensor | None:
        raise NotImplementedError

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The local GEMM ``x W_lᵀ (+ b_l for column parallel)``, in FP8 when enabled."""
        if self._fp8 is not None:
            return self._fp8_gemm(x)
        return self._linear(x, self._gemm_bias())

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The high-precision local GEMM, its weight gradient deferred with a sink."""
        if self.wgrad_sink is None:
            return F.linear(x, self.weight, bias)
        return _deferred_linear(x, self.weight, bias, self.wgrad_sink)

    @torch.compiler.disable  # one eager region with its bias (module docstring: compile)
    def _fp8_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`gemm` in FP8, bias included."""
        bias = self._gemm_bias()
        y = self._synced_fp8()(x)
        return y if bias is None else y + bias

    def _synced_fp8(self) -> Any:
        """The FP8 layer, its weight following parameter swaps (FSDP2 unsharding,
        ``load_state_dict(assign=True)``)."""
        if self._fp8.weight is not self.weight:
            self._fp8.weight = self.weight
        return self._fp8

    def enable_fp8(self, recipe: Any = None, **fp8_kwargs: Any) -> None:
        """Run the local GEMM through ``mt_fp8.FP8Linear`` with ``recipe``.

        The FP8Linear shares this layer's weight (no copy; the bias is added outside the FP8
        GEMM) and its ``fp8_meta`` (delayed-scaling state, amax group), both registered here
        too; the state dict keeps this layer's tp=1 names only
        (:func:`keep_fp8_layer_out_of_state_dict`). Its amax reduction covers
        ``fp8_sharded_roles`` (module docstring).
        """
        from mt_fp8 import FP8Linear

        local_out, local_in = self.weight.shape
        view = _LinearView(local_in, local_out, self.weight)
        fp8_kwargs.setdefault("amax_reduction_roles", self.fp8_sharded_roles)
        self._fp8 = FP8Linear.from_linear(view, recipe=recipe, **fp8_kwargs)  # type: ignore[arg-type]
        self.fp8_meta = self._fp8.fp8_meta
        keep_fp8_layer_out_of_state_dict(self)

    @property
    def fp8_enabled(self) -> bool:
        return self._fp8 is not None

    @property
    def fp8_linear(self) -> Any:
        """The ``mt_fp8.FP8Linear`` running this layer's local GEMM, or None without FP8."""
        return self._fp8

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.has_bias}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
            + (", fp8" if self._fp8 is not None else "")
        )


def keep_fp8_layer_out_of_state_dict(module: nn.Module) -> None:
    """``module._fp8``, the FP8 layer running ``module``'s GEMM, is a registered submodule (so
    module walks find it: FP8 health, weight caches, weight-gradient sinks) that shares
    ``module``'s weight and ``fp8_meta``. Its state-dict entries would repeat those tensors
    under ``_fp8.`` names, which a model without FP8 does not have: they are left out of the
    state dict, and a load fills them from ``module``'s own entries."""
    if getattr(module, "_fp8_state_hooks", False):
        return
    module.register_state_dict_post_hook(_drop_fp8_entries)
    module.register_load_state_dict_pre_hook(_fill_fp8_entries)
    module._fp8_state_hooks = True


def _drop_fp8_entries(module: nn.Module, state_dict: Any, prefix: str, metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "_fp8.")]:
        del state_dict[key]


def _fill_fp8_entries(module: nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
    fp8 = module._modules.get("_fp8")
    if fp8 is None:
        return
    for name in fp8.state_dict(keep_vars=True):
        if prefix + name in state_dict:
            state_dict[f"{prefix}_fp8.{name}"] = state_dict[prefix + name]


class _LinearView:
    """What ``FP8Linear.from_linear`` reads from an ``nn.Linear``: sizes, weight, no bias."""

    def __init__(self, in_features: int, out_features: int, weight: nn.Parameter) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.weight, self.bias = weight, None


class ColumnParallelLinear(_ParallelLinear):
    """``y = x Wᵀ + b`` with ``W``'s output rows split over TP (module docstring).

    ``forward`` = :meth:`prepare_input` (the communication) + :meth:`forward_prepared` (the GEMM);
    layers that read the same input (q/k/v, gate/up) share one prepared input, so sequence
    parallel all-gathers it once.
    """

    tp_shard_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}
    tp_shard_labels: ClassVar[dict[str, str]] = {"weight": "out_features", "bias": "out_features"}
    fp8_sharded_roles: ClassVar[tuple[str, ...]] = ("weight", "grad_output")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        init_std: float = DEFAULT_INIT_STD,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.gather_output = gather_output
        super().__init__(
            in_features, out_features, bias, tp_group, sequence_parallel, init_std, device, dtype
        )

    def _gemm_bias(self) -> torch.Tensor | None:
        return self.bias if self.has_bias else None

    def prepare_input(self, x_BTK: torch.Tensor) -> torch.Tensor:
        """The full input on every rank: SP all-gather along T, or gradient all-reduce."""
        if self.sequence_parallel:
            return all_gather_grad_rs(x_BTK, SEQUENCE_DIM, self.tp_group)
        return copy_to_group(x_BTK, self.tp_group)

    def forward_prepared(self, x_BTK: torch.Tensor) -> torch.Tensor:
        # FP8: the eager region straight from here, one frame fewer under torch.compile.
        y_BTN_l = self.gemm(x_BTK) if self._fp8 is None else self._fp8_gemm(x_BTK)
        if self.gather_output:
            return gather_from_group(y_BTN_l, y_BTN_l.dim() - 1, self.tp_group)
        return y_BTN_l

    def forward(self, x_BTK: torch.Tensor) -> torch.Tensor:
        return self.forward_prepared(self.prepare_input(x_BTK))


class RowParallelLinear(_ParallelLinear):
    """``y = x Wᵀ + b`` with ``W``'s input columns split over TP (module docstring)."""

    tp_shard_dims: ClassVar[dict[str, int]] = {"weight": 1}
    tp_shard_labels: ClassVar[dict[str, str]] = {"weight": "in_features"}
    fp8_sharded_roles: ClassVar[tuple[str, ...]] = ("input", "weight")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        init_std: float = DEFAULT_INIT_STD,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        super().__init__(
            in_features, out_features, bias, tp_group, sequence_parallel, init_std, device, dtype
        )

    def _gemm_bias(self) -> torch.Tensor | None:
        return None  # added after the reduction, once

    def forward(self, x_BTK_l: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x_BTK_l = scatter_to_group(x_BTK_l, x_BTK_l.dim() - 1, self.tp_group)
        if self._fp8 is not None:
            return self._fp8_forward(x_BTK_l)
        return self._reduce(self.gemm(x_BTK_l))

    @torch.compiler.disable  # one eager region with its reduction and bias (module docstring)
    def _fp8_forward(self, x_BTK_l: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` in FP8 from the local input shard."""
        return self._reduce(self._fp8_gemm(x_BTK_l))

    def forward_swiglu(self, gate_BTK_l: torch.Tensor, up_BTK_l: torch.Tensor) -> torch.Tensor:
        """``forward(swiglu(gate, up))`` for the local (column-parallel) ``gate`` and ``up``.

        In FP8 the local GEMM runs ``mt_fp8.FP8Linear.forward_swiglu``: ``swiglu(gate, up)`` is
        quantized straight from ``gate`` and ``up`` and never stored in high precision.
        """
        if not self.input_is_parallel:
            raise ValueError("RowParallelLinear.forward_swiglu needs input_is_parallel=True")
        if self._fp8 is None:
            return self._reduce(self._linear(swiglu(gate_BTK_l, up_BTK_l), None))
        return self._fp8_forward_swiglu(gate_BTK_l, up_BTK_l)

    @torch.compiler.disable  # one eager region with its reduction and bias (module docstring)
    def _fp8_forward_swiglu(self, gate_BTK_l: torch.Tensor, up_BTK_l: torch.Tensor) -> torch.Tensor:
        return self._reduce(self._synced_fp8().forward_swiglu(gate_BTK_l, up_BTK_l))

    def _reduce(self, partial_BTN: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (reduce-scatter under SP), then add the bias."""
        if self.sequence_parallel:
            y_BTN = reduce_scatter_grad_ag(partial_BTN, SEQUENCE_DIM, self.tp_group)
        else:
            y_BTN = reduce_from_group(partial_BTN, self.tp_group)
        if not self.has_bias:
            return y_BTN
        # Under SP each rank adds the bias to its own tokens: sum its gradient over TP.
        bias = copy_to_group(self.bias, self.tp_group) if self.sequence_parallel else self.bias
        return y_BTN + bias


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding table split by vocabulary rows over TP (module docstring)."""

    tp_shard_dims: ClassVar[dict[str, int]] = {"weight": 0}
    tp_shard_labels: ClassVar[dict[str, str]] = {"weight": "vocab_size"}

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        init_std: float = 1.0,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.init_std = (
            num_embeddings,
            embedding_dim,
            init_std,
        )
        self._setup_tp(tp_group, sequence_parallel)
        self._make_params(device, dtype)
        self.reset_parameters()

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.num_embeddings, self.embedding_dim)}

    def _init_full(self, name: str, full: torch.Tensor, generator: Any) -> None:
        full.normal_(0.0, self.init_std, generator=generator)

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids_BT, self.weight)
        vocab_l = self.weight.shape[0]
        start = self.tp_rank * vocab_l
        outside_BT = (ids_BT < start) | (ids_BT >= start + vocab_l)
        local_ids_BT = torch.where(outside_BT, 0, ids_BT - start)
        partial_BTD = F.embedding(local_ids_BT, self.weight)
        partial_BTD = partial_BTD.masked_fill(outside_BT.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_grad_ag(partial_BTD, SEQUENCE_DIM, self.tp_group)
        return reduce_from_group(partial_BTD, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def scaled_init_std(base_std: float, num_layers: int) -> float:
    """Megatron's output-layer init: ``std / sqrt(2·num_layers)`` for residual projections."""
    return base_std / math.sqrt(2.0 * num_layers)
