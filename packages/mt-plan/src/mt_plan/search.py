"""The search: every layout of a world size, pruned by the trainer's rules and by memory,
ranked by predicted tokens/s per GPU (pure Python; pipeline timings import torch once, see
:mod:`mt_plan.pipeline`).

Dimensions (each restricted by :class:`SearchSpace`): tp, cp, pp over the divisors of the world
(tp and cp within a node: their collectives are per layer), at cp > 1 the context-parallel
attention (``all_gather`` or ``ring``; the trainer refuses the ring with dropout), dp the rest, sequence parallel on
or off where tp > 1, the schedule and its chunks per rank when pp > 1, the data-parallel mode,
ep over the divisors of dp·cp that divide the experts, the micro-batch over the divisors of
``global_batch / dp``, the recompute policy (with full recompute also ``recompute_every``,
below) and the FP8 recipe. Pruning order: the world and batch arithmetic while enumerating,
then :func:`~mt_plan.layout.layout_problem` (the trainer's rules), then the cost model's memory
check. ``SearchResult.counts`` reports how many layouts each stage removed.

``recompute_every = N`` checkpoints blocks ``j`` with ``j % N == 0`` of each module mt-parallel
wraps (:meth:`~mt_plan.cost.CostModel.recomputed_layers`): of a module of ``n`` blocks, ``N`` and
``N' > N`` checkpoint the same blocks exactly when ``N ≥ n`` (both only block 0). So the search
tries the values of :attr:`SearchSpace.recompute_every` in increasing order and stops after the
first that is at least the longest chunk's block count (:func:`distinct_recompute_every`): no two
enumerated layouts recompute the same blocks.

The pipeline split is the trainer's automatic one, and with :attr:`SearchSpace.end_layers_off`
values ``k > 0`` also that split with ``k`` blocks moved off the last chunk (which carries the
head and the loss), and, for models with work before the decoder on the first chunk (the VLM's
vision tower), off the first chunk and off both (Megatron's ``decoder_first_pipeline_num_layers``
and ``decoder_last_pipeline_num_layers``), as explicit ``pp_layers``
(:func:`end_shifted_split`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import product

from mt_plan.cost import CostModel, Estimate
from mt_plan.layout import (
    CP_ATTENTION,
    DP_MODES,
    FP8_RECIPES,
    FULL_RECOMPUTE,
    RECOMPUTE,
    SCHEDULES,
    V_SCHEDULES,
    Layout,
    layout_problem,
    split_layers,
)
from mt_plan.shape import ModelShape

DIMENSIONS = ("tp", "sp", "cp", "cp_attention", "pp", "vpp", "schedule", "dp_mode", "ep",
              "micro_batch", "recompute", "recompute_every", "fp8")  # fmt: skip


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchSpace:
    """Which values each dimension may take (None: every valid value)."""

    tp: list[int] | None = None
    cp: list[int] | None = None
    pp: list[int] | None = None
    vpp: list[int] = field(default_factory=lambda: [1, 2, 4])
    schedules: list[str] = field(default_factory=lambda: list(SCHEDULES))
    sp: list[bool] = field(default_factory=lambda: [False, True])
    dp_modes: list[str] = field(default_factory=lambda: list(DP_MODES))
    ep: list[int] | None = None
    micro_batches: list[int] | None = None
    recompute: list[str] = field(default_factory=lambda: list(RECOMPUTE))
    recompute_every: list[int] = field(default_factory=lambda: [1, 2, 4])
    """``parallel.recompute_every`` values tried with the full recompute policies (module
    docstring); the others run every block's policy (1)."""
    fp8: list[str] | None = None
    """None: no FP8 and every recipe whose GEMMs the calibration table measured (recipes the
    table cannot tell apart would only tie)."""
    max_micro_batch: int = 16
    end_layers_off: list[int] = field(default_factory=lambda: [0])
    """Blocks moved off the end chunks of pipeline layouts (module docstring); 0: the automatic
    split only."""
    cp_attention: list[str] = field(default_factory=lambda: list(CP_ATTENTION))
    """``parallel.cp_attention`` values tried at cp > 1 (cp = 1 runs neither)."""

    def __post_init__(self) -> None:
        for name, values, valid in (
            ("cp-attention", self.cp_attention, CP_ATTENTION),
            ("schedule", self.schedules, SCHEDULES),
            ("dp_mode", self.dp_modes, DP_MODES),
            ("recompute", self.recompute, RECOMPUTE),
            ("fp8", self.fp8 or ["none"], FP8_RECIPES),
        ):
            unknown = [v for v in values if v not in valid]
            if unknown or not values:
                raise ValueError(f"--{name} {unknown or values}: valid values {', '.join(valid)}")
        off = self.end_layers_off
        if not off or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in off):
            raise ValueError(f"--end-layers-off {off}: non-negative integers (blocks moved)")
        every = self.recompute_every
        if not every or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in every):
            raise ValueError(
                f"--recompute-every {every}: positive integers (blocks per checkpoint)"
            )


@dataclass
class SearchResult:
    ranked: list[Estimate]
    """Layouts that fit, fastest first."""
    too_big: list[Estimate]
    """Valid layouts predicted not to fit, smallest peak memory first."""
    counts: dict[str, int]


def distinct_recompute_every(values: list[int], longest: int) -> list[int]:
    """``values`` in increasing order, up to the first that is at least ``longest`` (the most
    blocks a wrapped module has): the rest would checkpoint the same blocks (module docstring)."""
    out: list[int] = []
    for n in sorted(set(values)):
        if out and out[-1] >= longest:
            break
        out.append(n)
    return out


def end_shifted_split(
    n_layers: int, chunks: int, off_first: int, off_last: int
) -> tuple[int, ...] | None:
    """The trainer's automatic split of ``n_layers`` blocks over ``chunks`` with ``off_first``
    blocks moved off chunk 0 and ``off_last`` off the last chunk, one at a time onto the
    chunk holding fewest among the middle ones (the other end where there are none); None
    where an end would keep no block or nothing could take them."""
    counts = split_layers(n_layers, chunks)
    middle = list(range(1, chunks - 1))
    takers = middle or [c for c, off in ((0, off_first), (chunks - 1, off_last)) if not off]
    if chunks < 2 or not takers or counts[0] <= off_first or counts[-1] <= off_last:
        return None
    counts[0] -= off_first
    counts[-1] -= off_last
    for _ in range(off_first + off_last):
        counts[min(takers, key=counts.__getitem__)] += 1
    return tuple(counts)


def pipeline_splits(model: ModelShape, chunks: int, space: SearchSpace) -> list[tuple[int, ...]]:
    """``()`` (the automatic split) and the end-shifted splits the space asks for."""
    splits: list[tuple[int, ...]] = [()]
    if model.n_layers < chunks:  # the trainer refuses the layout anyway
        return splits
    for k in sorted({k for k in space.end_layers_off if k > 0}):
        ends = [(0, k)] + ([(k, 0), (k, k)] if model.blocks_before else [])
        for off_first, off_last in ends:
            split = end_shifted_split(model.n_layers, chunks, off_first, off_last)
            if split is not None and split not in splits:
                splits.append(split)
    return splits


def enumerate_layouts(
    world: int, gpus_per_node: int, global_batch: int, model: ModelShape, space: SearchSpace
) -> Iterator[Layout]:
    """Every combination of the space's values whose world and batch arithmetic works (pp and
    cp above 1 only where the model family runs them)."""  # fmt: skip
    node = min(world, gpus_per_node)
    tps = space.tp or [d for d in divisors(node)]
    for tp in tps:
        if world % tp:
            continue
        for cp in space.cp or (
            divisors(node // tp if node % tp == 0 else 1) if model.supports_cp else [1]
        ):
            if world % (tp * cp):
                continue
            for pp in space.pp or (divisors(world // (tp * cp)) if model.supports_pp else [1]):
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                per_dp = global_batch // dp
                mbs = space.micro_batches or [
                    d for d in divisors(per_dp) if d <= space.max_micro_batch
                ]
                eps = space.ep or ([1] if not model.num_experts else divisors(dp * cp))
                pipes = [("1f1b", 1)] if pp == 1 else [
                    (s, v) for s in space.schedules for v in (space.vpp if s in
                    ("interleaved_1f1b", "zero_bubble") else [1])
                ]  # fmt: skip
                rings = space.cp_attention if cp > 1 else ["all_gather"]
                for sp, cp_attention in product(space.sp if tp > 1 else [False], rings):
                    for schedule, vpp in pipes:
                        # the most blocks of a module apply_recompute numbers: the whole model
                        # at pp = 1, else the longest chunk of the splits tried
                        v = 2 if schedule in V_SCHEDULES else vpp
                        longest = model.n_layers + model.blocks_before
                        splits = pipeline_splits(model, pp * v, space) if pp > 1 else [()]
                        if pp > 1:
                            automatic = -(-model.n_layers // (pp * v))
                            longest = max([automatic, *(max(s) for s in splits if s)])
                        everies = distinct_recompute_every(space.recompute_every, longest)
                        policies = [
                            (rc, n) for rc in space.recompute
                            for n in (everies if rc in FULL_RECOMPUTE else [1])
                        ]  # fmt: skip
                        modes = space.dp_modes if dp * cp > 1 else space.dp_modes[:1]
                        for dp_mode in modes:
                            for ep in eps:
                                for mb in mbs:
                                    for rc, every in policies:
                                        for fp8, split in product(space.fp8 or ["none"], splits):
                                            yield Layout(
                                                tp=tp, cp=cp, cp_attention=cp_attention,
                                                pp=pp, dp=dp, ep=ep, sp=sp,
                                                vpp=vpp, schedule=schedule, dp_mode=dp_mode,
                                                micro_batch=mb, recompute=rc,
                                                recompute_every=every, fp8=fp8,
                                                pp_layers=split,
                                            )  # fmt: skip


def search(cost: CostModel, world: int, space: SearchSpace | None = None) -> SearchResult:
    """Score every valid layout of ``world`` GPUs (module docstring)."""
    space = space or SearchSpace()
    md, w = cost.model, cost.work
    if space.fp8 is None:
        measured = [r for r in FP8_RECIPES[1:] if cost.table.has_gemm(f"fp8_{r}")]
        space = replace(space, fp8=["none", *measured])
    counts = {"enumerated": 0, "rule": 0, "memory": 0, "fits": 0}
    fits: list[Estimate] = []
    too_big: list[Estimate] = []
    for layout in enumerate_layouts(world, cost.cluster.gpus_per_node, w.global_batch, md, space):
        counts["enumerated"] += 1
        if layout_problem(layout, md, world, w.global_batch, w.seq_len) is not None:
            counts["rule"] += 1
            continue
        est = cost.estimate(layout)
        if est.fits:
            counts["fits"] += 1
            fits.append(est)
        else:
            counts["memory"] += 1
            too_big.append(est)
    fits.sort(key=lambda e: -e.tokens_per_s_per_gpu)
    too_big.sort(key=lambda e: e.peak_memory)
    return SearchResult(fits, too_big, counts)


def smallest_world_that_fits(
    cost: CostModel, start: int, limit: int, space: SearchSpace | None = None
) -> tuple[int, Estimate] | None:
    """The smallest power-of-two GPU count ≥ ``start`` (whole nodes above one node) with a
    layout that fits, or None up to ``limit`` GPUs; searches only memory-saving settings (full
    recompute, micro-batch 1, 1F1B) to stay quick."""
    node = cost.cluster.gpus_per_node
    lean = SearchSpace(
        tp=None, cp=[1], pp=None, vpp=[1], schedules=["1f1b"], sp=[True, False],
        dp_modes=["fsdp", "zero1", "ddp"], micro_batches=[1], recompute=["full"],
        recompute_every=[1], fp8=(space.fp8 if space else ["none"]),
    )  # fmt: skip
    candidates, n = [], 1
    while n <= limit:
        if n >= start and (n <= node or n % node == 0):
            candidates.append(n)
        n *= 2
    for n in candidates:
        cm = CostModel(cost.model, cost.cluster.with_gpus(n), cost.table, cost.work)
        result = search(cm, n, lean)
        if result.ranked:
            return n, result.ranked[0]
    return None
