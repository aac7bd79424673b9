"""Count the device kernels and host reads of one decoder layer of mt's runtime, on the CPU.

Run as ``python plan_launch_counts.py`` (it sets ``TRITON_INTERPRET=1`` for itself, so mt-fp8's
fused ops take their Triton kernels, as on CUDA); prints one JSON object keyed like
``mt_plan.cost.KERNEL_LAUNCHES``: ``"<family>/<recipe>"`` → forward and backward counts of one
layer (the difference of the same model with one layer more) and, for MoE layers, of each
local expert (the difference of two expert counts; the layer's own count is then its count
without the experts' part), plus the host reads per layer and the kernels of the embedding and
head.

What counts as one kernel launch: every aten op the dispatcher runs except views, allocations
and metadata (:data:`NO_KERNEL`, which launch nothing on CUDA), every Triton kernel launch (the
interpreter's own aten calls are not counted), every ``mt_fp8.fp8_gemm`` and grouped FP8 GEMM
call as one (the CPU emulates them with several ops; CUDA runs one library kernel). The CUDA
paths are forced where the CPU would take another: the grouped FP8 GEMM's device check is
passed and the GEMM replaced by a one-op stand-in (as ``test_moe_fp8_ops.py`` does), and the
router's choice replaced by round-robin routing (the router still runs), so that no expert
idles, as the cost model assumes, and the per-expert loops' counts are linear in the experts. A host
read is a ``tolist``/``item`` of a tensor (``_local_scalar_dense``, ``nonzero``, ``tolist``).

``--cuda`` (on a GPU) cross-checks the method: the same models on CUDA without forcing
anything, kernels counted from the profiler's launch calls and host reads from its
synchronizing copies, and the host's wall clock per launch of the layer (the tiny layers are
host-bound, so that is the runtime's own host cost per kernel).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys

if "--cuda" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

NO_KERNEL = {
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.empty_like.default", "aten.detach.default",
    "aten.lift_fresh.default", "aten.alias.default", "aten.set_.source_Storage",
    "aten.set_.source_Storage_storage_offset", "aten.is_same_size.default",
    "aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.sym_size.int",
    "aten.sym_stride.int", "aten.sym_numel.default", "aten.sym_storage_offset.default",
    "aten.record_stream.default", "aten._has_compatible_shallow_copy_type.default",
}  # fmt: skip
"""aten ops that launch no kernel on CUDA (views are recognized by ``func.is_view``)."""
HOST_READS = ("aten._local_scalar_dense.default", "aten.nonzero.default")
TINY = [
    "model.dim=128", "model.n_heads=2", "model.ffn_dim=256", "model.vocab_size=256",
]  # fmt: skip
FAMILIES = {
    "llama": ["model=llama3_8b", *TINY, "model.n_kv_heads=1"],
    "moe": ["model=mixtral_8x7b", *TINY, "model.n_kv_heads=1", "model.moe.expert_ffn_dim=128"],
    "mla_moe": ["model=deepseek_v2_lite", *TINY, "model.kv_lora_rank=64",
                "model.qk_nope_head_dim=64", "model.qk_rope_head_dim=64", "model.v_head_dim=64",
                "model.moe.expert_ffn_dim=128", "model.first_k_dense=0"],
}  # fmt: skip
"""Tiny models of the validated families: Llama (GQA, dense), Mixtral (GQA, routed experts),
DeepSeek-V2-Lite (MLA, routed and shared experts)."""
RECIPES = ("none", "tensorwise", "rowwise", "delayed")
EXPERTS = (8, 16)
SEQ = 60
"""Tokens of the counted micro-batch: with top-2 (Mixtral) and top-6 (V2-Lite) routing over 8
and 16 experts, no group is a multiple of 16 rows, as routed groups are not (the grouped FP8
wgrad pads such groups, a per-expert cost)."""


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.reads = 0
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in HOST_READS:
            self.reads += 1
        if not func.is_view and name not in NO_KERNEL:
            self.kernels += 1
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def launch(self, fn, *args, **kwargs):
        """``fn`` counted as one kernel, its own dispatches not."""
        self.kernels += 1
        self.ops[getattr(fn, "__name__", "launch")] += 1
        with _disable_current_modes():
            return fn(*args, **kwargs)


_active: list[_Count] = []


def _as_one_launch(fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        if not _active:
            return fn(*args, **kwargs)
        return _active[-1].launch(fn, *args, **kwargs)

    return counted


def _one_op_grouped_mm(a, b, scale_a, scale_b, offs):
    """A stand-in for ``torch._scaled_grouped_mm`` (its output, one op)."""
    if b.dim() == 3:
        return a.new_zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16)
    return a.new_zeros(len(offs), a.shape[0], b.shape[1], dtype=torch.bfloat16)


def _force_cuda_paths() -> None:
    """Triton launches, FP8 GEMMs and the grouped FP8 path as on CUDA (module docstring)."""
    import triton.runtime.interpreter as interpreter

    import mt_fp8.functional as functional
    import mt_fp8.grouped as grouped
    import mt_fp8.linear as linear

    interpreter.GridExecutor.__call__ = _as_one_launch(interpreter.GridExecutor.__call__)
    functional.fp8_gemm = _as_one_launch(functional.fp8_gemm)
    grouped.fp8_gemm = _as_one_launch(grouped.fp8_gemm)
    _balance_routing()
    grouped._device_reason = lambda device: None
    fast = functools.partial(
        grouped.fp8_grouped_linear, grouped_gemm=_as_one_launch(_one_op_grouped_mm)
    )
    linear.fp8_grouped_linear = fast
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        if _active:
            _active[-1].reads += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist


def _balance_routing() -> None:
    """Every token routed to the next ``top_k`` experts round-robin (the router still runs, its
    own kernels counted): no expert idles, as the cost model assumes, and the per-expert loops'
    counts do not depend on the tiny model's skewed initial routing."""
    import dataclasses

    from mt_parallel.moe import router

    route = router.Router.forward

    def balanced(self, x_BSD):
        routing = route(self, x_BSD)
        with _disable_current_modes():
            tokens, k = routing.indices_TK.shape
            experts = routing.counts_E.numel()
            order = torch.arange(tokens * k, device=routing.indices_TK.device)
            indices = (order % experts).view(tokens, k).to(routing.indices_TK.dtype)
            counts = torch.bincount(indices.flatten(), minlength=experts)
        return dataclasses.replace(
            routing, indices_TK=indices, counts_E=counts.to(routing.counts_E.dtype)
        )

    router.Router.forward = balanced


def _built(overrides: list[str], device: str) -> torch.nn.Module:
    """The model ``overrides`` describe, built on ``device`` and parallelized alone as the
    trainer does."""
    import mt_comm
    import mt_parallel as mp
    from mt_plan.models import resolve
    from mt_train.models import build_model, parallelize

    train = resolve(overrides)
    state = mt_comm.init_parallel_state(dp=1)
    try:
        model = build_model(train.model, device, seed=1)
        return parallelize(model, train.model, mp.ParallelConfig(), state, train.fp8)
    finally:
        mt_comm.destroy_parallel_state()


def count_model(overrides: list[str]) -> tuple[int, int, int]:
    """(forward kernels, backward kernels, host reads) of one forward and backward of the
    model ``overrides`` describe, built on the CPU and parallelized alone as the trainer does,
    under bf16 autocast."""
    model = _built(overrides, "cpu")
    torch.manual_seed(0)  # the routing, and so the per-expert loops' empty experts, repeat
    tokens = torch.randint(0, 256, (1, SEQ))
    targets = torch.randint(0, 256, (1, SEQ))
    counter = _Count()
    _active.append(counter)
    try:
        with counter, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(model(tokens), targets)
            loss = loss[0] if isinstance(loss, tuple) else loss  # MoE: (loss, extras)
            forward = counter.kernels
        with counter:
            loss.backward()
    finally:
        _active.pop()
    return forward, counter.kernels - forward, counter.reads


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
READ_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def count_model_cuda(overrides: list[str]) -> tuple[int, int, int, float]:
    """:func:`count_model` on CUDA from the profiler's launch and synchronize calls, and the
    host's seconds for the forward and backward (median of five after two warm-ups)."""
    import statistics
    import time

    model = _built(overrides, "cuda")
    tokens = torch.randint(0, 256, (1, SEQ), device="cuda")
    targets = torch.randint(0, 256, (1, SEQ), device="cuda")

    def step() -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(model(tokens), targets)
            loss = loss[0] if isinstance(loss, tuple) else loss
        middle = time.perf_counter()
        loss.backward()
        return middle - start, time.perf_counter() - middle

    seconds = []
    for _ in range(7):
        torch.cuda.synchronize()
        seconds.append(sum(step()))
        torch.cuda.synchronize()

    def calls(events) -> tuple[int, int]:
        names = [e.name for e in events]
        return sum(n in LAUNCH_CALLS for n in names), sum(n in READ_CALLS for n in names)

    both = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    with torch.profiler.profile(activities=both) as forward, autocast:
        loss = model.loss(model(tokens), targets)
        loss = loss[0] if isinstance(loss, tuple) else loss
    with torch.profiler.profile(activities=both) as backward:
        loss.backward()
    counts = [calls(forward.events()), calls(backward.events())]
    (fwd, fwd_reads), (bwd, bwd_reads) = counts
    return fwd, bwd, fwd_reads + bwd_reads, statistics.median(seconds[2:])


def count_all_cuda() -> dict[str, dict[str, float]]:
    """Per ``family/recipe`` on CUDA: one layer's kernels and reads (module docstring) and the
    host seconds per launch of that layer."""
    import mt_comm

    mt_comm.init_distributed(device="cuda")
    out = {}
    for family in (*FAMILIES, "mla"):
        for recipe in RECIPES:
            one = count_model_cuda(_overrides(family, recipe, 1, EXPERTS[0]))
            two = count_model_cuda(_overrides(family, recipe, 2, EXPERTS[0]))
            launches = two[0] + two[1] - one[0] - one[1]
            out[f"{family}/{recipe}"] = {
                "forward": two[0] - one[0], "backward": two[1] - one[1],
                "host_reads": two[2] - one[2],
                "host_s_per_launch": (two[3] - one[3]) / max(launches, 1),
                "step_s_one_layer": one[3], "step_s_two_layers": two[3],
            }  # fmt: skip
            print(family, recipe, out[f"{family}/{recipe}"], file=sys.stderr, flush=True)
    return out


def _overrides(family: str, recipe: str, layers: int, experts: int) -> list[str]:
    """The tiny model of ``family`` with ``layers`` decoder layers. ``mla`` (a dense MLA
    layer): DeepSeek's MoE model with ``layers - 1`` dense layers before one MoE layer (the
    family needs one), so that two layers less one is the dense layer."""
    base = FAMILIES["mla_moe" if family == "mla" else family]
    extra = [] if recipe == "none" else [f"fp8={recipe}"]
    if family != "llama":
        extra.append(f"model.moe.num_experts={experts}")
    if family == "mla":
        extra.append(f"model.first_k_dense={layers - 1}")
    return [*base, *extra, f"model.n_layers={layers}"]


def count_all(keys: list[str]) -> dict[str, dict[str, float]]:
    """Per ``family/recipe`` of ``keys``: one layer's forward and backward kernels and host
    reads, those of the embedding and head, and for MoE families the kernels per local expert
    (module docstring)."""
    import mt_comm

    mt_comm.init_distributed(device="cpu")
    out = {}
    for key in keys:
        family, recipe = key.split("/")
        one = count_model(_overrides(family, recipe, 1, EXPERTS[0]))
        two = count_model(_overrides(family, recipe, 2, EXPERTS[0]))
        counts = {
            "forward": two[0] - one[0], "backward": two[1] - one[1],
            "host_reads": two[2] - one[2],
            "ends_forward": 2 * one[0] - two[0], "ends_backward": 2 * one[1] - two[1],
            "expert_forward": 0.0, "expert_backward": 0.0,
        }  # fmt: skip
        if family == "mla":  # its one-layer model's layer is an MoE one: its ends are mla_moe's
            del counts["ends_forward"], counts["ends_backward"]
        if family in ("moe", "mla_moe"):
            more = count_model(_overrides(family, recipe, 1, EXPERTS[1]))
            per_f = (more[0] - one[0]) / (EXPERTS[1] - EXPERTS[0])
            per_b = (more[1] - one[1]) / (EXPERTS[1] - EXPERTS[0])
            # the layer's count without its local experts' part, as KERNEL_LAUNCHES keeps it
            counts["forward"] -= EXPERTS[0] * per_f
            counts["backward"] -= EXPERTS[0] * per_b
            counts["expert_forward"], counts["expert_backward"] = per_f, per_b
        out[key] = counts
        print(key, counts, file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    if "--cuda" in sys.argv:
        json.dump(count_all_cuda(), sys.stdout, indent=1)
    else:
        _force_cuda_paths()
        keys = [a for a in sys.argv[1:] if "/" in a] or [
            f"{family}/{recipe}" for family in (*FAMILIES, "mla") for recipe in RECIPES
        ]
        json.dump(count_all(keys), sys.stdout, indent=1)
    print()
