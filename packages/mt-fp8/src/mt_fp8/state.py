"""Per-module FP8 state: the delayed-scaling amax history and scales, and numerics health.

:class:`FP8Meta` is a small ``nn.Module`` each FP8 layer owns as ``fp8_meta``, so its tensors
follow ``.to()`` and ``state_dict`` like any buffer (plain tensors: safetensors-friendly, no
pickled extra state). Roles index the last axis (:class:`~mt_fp8.formats.TensorRole`: input 0,
weight 1, grad_output 2).

Delayed scaling (buffers present only when the recipe is :class:`~mt_fp8.recipes.DelayedScaling`):

* ``amax_history`` ``(L, 3)`` fp32, persistent. Row 0 collects this step's amax (MAX over the
  micro-batches); rows 1..L-1 are the previous steps, newest first.
* ``scale`` ``(3,)`` fp32, persistent: the dequantization scales used during the step.

:func:`update_fp8_scales`, called once after each optimizer step, reduces row 0 with MAX over
the caller's process group (one all-reduce for all modules; NaN travels as ``+inf``), computes
``s = amax · 2^margin / fmt.max`` (:func:`mt_fp8.quantized.scale_from_amax`: at least
``2^-126``, capped at the fp32 maximum) with ``amax = max(history)`` or ``history[0]``
(``most_recent``), then rolls the history by one and clears row 0. Non-finite history entries
(a step whose tensor held ``inf`` or NaN) are ignored: they carry no usable range, and one of
them would otherwise make the scale infinite, i.e. every later value quantize to zero for the
whole window. Where no finite nonzero amax is left, the old scale is kept.

Until the first update (``scales_ready`` false: a new layer, or one whose history was reset),
the layer quantizes with *current* scales, ``s = max|x| / fmt.max`` of each tensor now, and
records the amaxes as usual, so the first update starts from real ranges. Without this the
initial scales of 1 would saturate every value above ``fmt.max`` and, worse, flush to zero
every gradient below E5M2's smallest subnormal (2^-16): a first step's output gradients
(about ``1/tokens``) mostly are. float8_experimental, torchao's predecessor, initialised its
delayed scales from the first tensors the same way. ``update_fp8_scales`` sets
``scales_ready``; ``load_state_dict`` sets it when the loaded history holds a recorded amax,
and code that copies the buffers in directly (mt-train's checkpoint loader) calls
:meth:`FP8Meta.after_load` for the same.

Tied input scales (:func:`tie_input_scales`): layers that read the same tensor (q/k/v of one
normalised input, gate/up of the MLP) record equal INPUT amaxes and so would compute equal
INPUT scales, but a layer cannot know that without a host sync. Tying makes it structural: the
tied layers' INPUT role uses the first layer's history and scale (``FP8Meta.input_meta``), so
they quantize the shared input once (:mod:`mt_fp8.input_cache`), as a
fused QKV or gate/up layer would. The INPUT column of the other layers' history stays zero and
their own INPUT scale unused; their WEIGHT and GRAD_OUTPUT roles keep their own state.

Health (always): ``health`` ``(3, 3)`` int64, not persistent: per role the counts of values
clipped at the format maximum, nonzero values flushed to zero, and all values, accumulated on the
device without a sync; :func:`fp8_health` reads them as fractions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mt_fp8.formats import TensorRole
from mt_fp8.quantized import scale_from_amax
from mt_fp8.recipes import DelayedScaling, Recipe

HEALTH_FIELDS = ("saturated", "underflow")


class FP8Meta(nn.Module):
    """Buffers an FP8 layer carries between steps (see the module docstring)."""

    def __init__(self, recipe: Recipe, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer(
            "health", torch.zeros(3, 3, dtype=torch.int64, device=device), persistent=False
        )
        self.scale_version = 0
        """Bumped whenever ``scale`` changes, so cached FP8 weights are requantized."""
        self.amax_group: dist.ProcessGroup | None = None
        """The amax-reduction group of the last ``fp8_autocast`` this module ran under."""
        self.history_len = 0
        self._input_meta: tuple[FP8Meta, ...] = ()
        """The meta whose INPUT scale this one uses (:func:`tie_input_scales`); a tuple so that
        ``nn.Module`` does not register it as a submodule."""
        self.scales_ready = False
        """Whether ``scale`` holds scales from recorded amaxes (module docstring); until then
        the layer uses current scaling."""
        self.ensure_delayed(recipe)

    def ensure_delayed(self, recipe: Recipe) -> None:
        """Create the delayed-scaling buffers if ``recipe`` needs them and they are missing."""
        if not isinstance(recipe, DelayedScaling) or self.history_len == recipe.amax_history_len:
            return
        device = self.health.device
        history = torch.zeros(recipe.amax_history_len, 3, device=device)
        self.register_buffer("amax_history", history)
        self.register_buffer("scale", torch.ones(3, device=device))
        self.history_len = recipe.amax_history_len
        self.scales_ready = False
        self.scale_version += 1

    def after_load(self) -> None:
        """After the buffers were overwritten: cached FP8 weights are stale, and the loaded
        scales are used if the loaded history holds a recorded amax (one host sync)."""
        self.scale_version += 1
        if self.has_delayed_state:
            history = self.amax_history
            self.scales_ready = bool((torch.isfinite(history) & (history > 0)).any())

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.after_load()

    @property
    def input_meta(self) -> FP8Meta:
        """The meta holding this layer's INPUT history and scale: itself unless tied."""
        return self._input_meta[0] if self._input_meta else self

    def meta_for(self, role: TensorRole) -> FP8Meta:
        """The meta holding ``role``'s delayed-scaling history and scale."""
        return self.input_meta if role is TensorRole.INPUT else self

    @property
    def has_delayed_state(self) -> bool:
        return self.history_len > 0

    def record_amax(self, x: torch.Tensor, role: TensorRole) -> None:
        """MAX this tensor's amax into the current step's slot (no host sync)."""
        self.record_amax_value(x.detach().abs().amax(), role)

    def record_amax_value(self, amax: torch.Tensor, role: TensorRole) -> None:
        """MAX an already computed amax into the current step's slot."""
        current = self.amax_history[0, int(role)]
        current.copy_(torch.maximum(current, amax.float()))

    def extra_repr(self) -> str:
        return f"amax_history_len={self.history_len}" if self.has_delayed_state else ""


def tie_input_scales(metas: Sequence[FP8Meta]) -> None:
    """Make every meta of ``metas`` use the first one's INPUT history and scale (module
    docstring). Only for layers that always read the same input tensor; the first meta must
    not itself be tied to another one."""
    if not metas:
        return
    owner = metas[0]
    if owner._input_meta:
        raise ValueError("the first meta of tie_input_scales is tied to another meta already")
    for meta in metas[1:]:
        if meta is owner:
            continue
        if meta.history_len != owner.history_len:
            raise ValueError(
                f"tie_input_scales: amax history lengths differ ({meta.history_len} and "
                f"{owner.history_len}); tie layers that run the same recipe"
            )
        meta._input_meta = (owner,)
        meta.scale_version += 1


def fp8_metas(model: nn.Module) -> list[tuple[str, FP8Meta]]:
    """Every :class:`FP8Meta` in ``model``, with the name of the layer that owns it."""
    return [
        (name.rsplit(".fp8_meta", 1)[0] if name != "fp8_meta" else "", module)
        for name, module in model.named_modules()
        if isinstance(module, FP8Meta)
    ]


@functools.cache
def format_maxima_on(device: torch.device, maxima: tuple[float, ...]) -> torch.Tensor:
    """The per-role format maxima as an fp32 tensor on ``device``, made once per device and
    formats. Why cached: creating it from Python numbers is a blocking host-to-device copy, which
    waits for every kernel queued before it. Made per update, it held the host after each
    optimizer step until the AdamW pass had finished, so the device then idled while the host
    launched the rest of the update and the next step (docs/benchmarks-log.md).
    Callers must not modify the returned tensor."""
    return torch.tensor(maxima, dtype=torch.float32, device=device)


@torch.no_grad()
def update_fp8_scales(
    model: nn.Module, recipe: DelayedScaling, amax_group: dist.ProcessGroup | None = None
) -> None:
    """End-of-step delayed-scaling update for every FP8 layer in ``model`` (module docstring).

    ``amax_group`` (default: the group each layer last ran under in ``fp8_autocast``, if any)
    is where amaxes are MAX-reduced so that all ranks agree on the scales; layers without a
    group are not reduced.
    """
    metas = [meta for _, meta in fp8_metas(model) if meta.has_delayed_state]
    by_group: dict[int, tuple[dist.ProcessGroup | None, list[FP8Meta]]] = {}
    for meta in metas:
        group = amax_group if amax_group is not None else meta.amax_group
        by_group.setdefault(id(group), (group, []))[1].append(meta)
    for group, members in by_group.values():
        if group is not None:
            current_B3 = torch.stack([meta.amax_history[0] for meta in members])
            current_B3 = torch.where(
                torch.isnan(current_B3), torch.full_like(current_B3, float("inf")), current_B3
            )
            dist.all_reduce(current_B3, op=dist.ReduceOp.MAX, group=group)
            torch._foreach_copy_(
                [meta.amax_history[0] for meta in members], list(current_B3.unbind(0))
            )
    if not metas:
        return
    # Metas whose buffers agree in length, dtypes and device are updated as one batch: stacked,
    # the math of one layer applied elementwise to all of them at once (the same operations on
    # the same values, so the same bits), and every result written back by one multi-tensor
    # copy. A loop over layers launched about ten small kernels per layer: hundreds per
    # optimizer step, each costing host time.
    batches: dict[tuple[int, torch.dtype, torch.dtype, torch.device], list[FP8Meta]] = {}
    for meta in metas:
        key = (meta.history_len, meta.amax_history.dtype, meta.scale.dtype, meta.scale.device)
        batches.setdefault(key, []).append(meta)
    targets: list[torch.Tensor] = []
    results: list[torch.Tensor] = []
    for (_, _, _, device), batch in batches.items():
        fmt_max = format_maxima_on(
            device, tuple(recipe.formats.for_role(role).max for role in TensorRole)
        )
        history_BL3 = torch.stack([meta.amax_history for meta in batch])
        usable_BL3 = torch.where(torch.isfinite(history_BL3), history_BL3, 0.0)
        amax_B3 = usable_BL3.amax(dim=1) if recipe.amax_compute_algo == "max" else usable_BL3[:, 0]
        new_scale_B3 = scale_from_amax(amax_B3, fmt_max, margin=recipe.margin)
        old_scale_B3 = torch.stack([meta.scale for meta in batch])
        scale_B3 = torch.where(amax_B3 > 0, new_scale_B3, old_scale_B3)
        history_BL3 = torch.roll(history_BL3, 1, dims=1)
        history_BL3[:, 0] = 0.0
        targets += [meta.scale for meta in batch] + [meta.amax_history for meta in batch]
        results += [*scale_B3.unbind(0), *history_BL3.unbind(0)]
    torch._foreach_copy_(targets, results)
    for meta in metas:
        meta.scale_version += 1
        meta.scales_ready = True


def fp8_health(model: nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    """Per layer and role, the fractions of values saturated and flushed to zero so far.

    ``{"layers.0.proj": {"input": {"saturated": 0.0, "underflow": 1e-4}, ...}, ...}``; roles
    never quantized are left out. One host sync for the whole model.
    """
    entries = fp8_metas(model)
    if not entries:
        return {}
    counts = torch.stack([meta.health for _, meta in entries]).cpu()
    report: dict[str, dict[str, dict[str, float]]] = {}
    for (name, _), layer_counts in zip(entries, counts, strict=True):
        roles = {}
        for role in TensorRole:
            saturated, underflow, total = layer_counts[int(role)].tolist()
            if total:
                roles[role.name.lower()] = {
                    "saturated": saturated / total,
                    "underflow": underflow / total,
                }
        report[name] = roles
    return report


def fp8_saturation_summary(model: nn.Module) -> tuple[torch.Tensor, list[str]]:
    """The largest saturated fraction over FP8 layers and roles since the last reset, computed
    on the device without a host sync: ``(summary, places)``, ``summary`` a float64 tensor
    ``[fraction, index]`` and ``places[index]`` the ``"layer:role"`` it belongs to (the first
    such place on ties, as a scan of :func:`fp8_health` would find it). Roles never quantized
    count as 0. Without FP8 layers: ``(tensor([0., 0.]), [])`` on the CPU.

    For a training loop that already synchronises once per step for its loss: stacking
    ``summary`` into that transfer makes the saturation check cost no sync of its own.
    """
    entries = fp8_metas(model)
    if not entries:
        return torch.zeros(2, dtype=torch.float64), []
    counts_L33 = torch.stack([meta.health for _, meta in entries])  # (layer, role, count)
    saturated, total = counts_L33[..., 0].double(), counts_L33[..., 2].double()
    fraction = torch.where(total > 0, saturated / total.clamp(min=1), 0.0).flatten()
    # max over a dim returns the first maximum's index, as a device tensor (indexing with a 0-d
    # tensor instead, fraction[index], reads the index on the host: a sync).
    worst, index = fraction.max(dim=0)
    places = [f"{name}:{role.name.lower()}" for name, _ in entries for role in TensorRole]
    return torch.stack([worst, index.double()]), places


def reset_fp8_health(model: nn.Module) -> None:
    """Zero the health counters (e.g. after each logging interval): one multi-tensor kernel
    launch for the whole model where the device has one, not one memset per layer."""
    counters = [meta.health for _, meta in fp8_metas(model)]
    if counters:
        torch._foreach_zero_(counters)
