"""``mt-plan calibrate``: measure the calibration table on this device (imports torch).

What is timed is what the trainer runs. GEMMs: each of a linear's three passes (forward, dgrad,
wgrad) through the call and with the operand layouts training gives it
(:mod:`mt_plan.calibration`, "GEMM passes"), on the GEMM's own shape: in bf16 (fp32 on the CPU,
which has no fast bf16 GEMM) ``F.linear(x, w)``, ``dy @ w`` and ``dyᵀ @ x`` (:func:`linear_gemms`:
the calls autograd makes for ``F.linear``, ``w`` stored [out, in]); under each FP8 recipe
``mt_fp8.fp8_gemm`` on the operands ``mt_fp8.functional`` builds for them through an
``FP8Linear``'s own plan (:func:`fp8_linear_gemms`: the GEMM only, quantization is its own
memory-bound op); the grouped GEMM ``torch._grouped_mm`` the bf16 MoE experts use where it
runs, again per pass as autograd runs it for ``GroupedLinear`` (:func:`grouped_gemms`; the FP8
experts' grouped GEMMs are inside their ``grouped_linear`` entries, below). Then the expert
linears as mt runs them (below), SDPA's causal attention forward and forward + backward (the
backward's time is the difference), and mt-fp8's fused ops (RMSNorm, SwiGLU, RoPE,
cross-entropy) forward + backward, ``mt_fp8.FusedAdamW``'s step, the tensorwise quantizer and a
device copy. Rates are per the minimum work: ``2·M·N·K`` FLOPs for a GEMM, the causal attention
FLOPs of :mod:`mt_plan.cost`, and for memory-bound ops the bytes :mod:`mt_plan.cost` charges
them, so a measured rate plugs straight into the model. NOTE: the table once timed ``a @ b`` on
row-major random matrices for every GEMM, which is dgrad's layout alone, and the profiled
training GEMMs ran faster than those rates (docs/plan.md, "GEMM layouts in the calibration").

Expert linears (``grouped_linear_fwd`` / ``grouped_linear_bwd``, dtype ``bf16`` and
``fp8_<recipe>``, shape ``[rows, N, K, groups]``): one projection of the routed experts through
the module mt-parallel's experts call, so the time is its whole path. bf16:
``mt_parallel.moe.experts.GroupedLinear`` (the fp32 weight's cast and its gradient's cast
back, CUDA's group padding, whose layout training computes once per MLP and this once per
call, ``torch._grouped_mm`` forward and backward). FP8, each recipe:
``mt_fp8.FP8GroupedLinear`` with the formats the trainer gives the experts by default
(``mt_parallel.expert_recipe``, ``fp8.expert_formats=auto``: E4M3 for every role under rowwise,
block and MXFP8, the recipe's E5M2 gradients under tensorwise and delayed), so the time covers
quantizing the input and the output gradient per group, the wgrad operands' padding of
unaligned groups, ``torch._scaled_grouped_mm`` where recipe and formats allow it and one GEMM
per expert where they do not (E5M2 gradients keep dgrad and wgrad per expert), and the fp32
weight gradient; its weight's FP8 cache is warm (the trainer requantizes once per step, which
the cost model charges with the optimizer). The input is bf16 under bf16 autocast with an fp32
weight, as in training (fp32 on the CPU). Group sizes are uneven and not multiples of 16
(:func:`routed_sizes`), as routed groups are. The backward's time is forward + backward minus
the forward; rates are per ``2·rows·N·K`` FLOPs forward and twice that backward. Shapes:
Mixtral-8x7B's few large experts and DeepSeek's many small ones (V2-Lite's 64, V3's 256 over
ep = 8), both projection orientations.

Host costs (``kernel_launch``, ``host_read``; :mod:`mt_plan.calibration`, "Host costs"): the
host's wall clock around ``launches`` in-place adds to a 16-element tensor, enqueued back to back
after the device has drained (each kernel runs in less time than its launch takes, so the host
never waits on a full launch queue), divided by ``launches``; and around ``reads`` ``tolist()``
calls of an 8-element int64 tensor on the idle device (the FP8 experts' ``sizes.tolist()``),
divided by ``reads``. Rates are events a second.

Timing: CUDA events around ``repeat`` calls after ``warmup`` calls, the median of ``trials``
(wall clock on other devices). ``--tiny`` uses small shapes, fewer repeats and only the
tensorwise FP8 recipe so the whole table is measured in seconds on a CPU (a smoke test of the
command, not a calibration).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from mt_plan.calibration import CalibrationTable, Entry, gemm_pass_shapes

FULL_GEMMS = [(m, n, k) for m in (2048, 8192, 16384) for n in (1024, 4096, 8192, 14336, 28672)
              for k in (1024, 4096, 8192, 14336)]  # fmt: skip
"""(tokens, out, in) of the linears whose three GEMMs are timed."""
TINY_GEMMS = [(128, 256, 384), (384, 128, 256)]
FULL_GROUPED = [(rows, n, k, g) for rows in (8192, 32768) for (n, k) in ((14336, 4096), (2048, 7168))
                for g in (8, 32)]  # fmt: skip
"""(rows, out, in, groups) of the grouped linears whose three grouped GEMMs are timed."""
TINY_GROUPED = [(256, 96, 64, 4)]
FULL_ATTENTION = [(bh, s, d) for bh in (8, 32, 64) for s in (2048, 4096, 8192) for d in (128, 192)]
TINY_ATTENTION = [(4, 64, 32)]
FULL_ROWS = [(8192, 4096), (16384, 8192), (8192, 14336), (8192, 28672)]
TINY_ROWS = [(64, 64)]
EXPERT_PROJECTIONS = [(14336, 4096, 8), (4096, 14336, 8), (1408, 2048, 64), (2048, 1408, 64),
                      (2048, 7168, 32), (7168, 2048, 32)]  # fmt: skip
"""(N, K, experts) of Mixtral-8x7B's, DeepSeek-V2-Lite's and DeepSeek-V3's (ep = 8) projections."""
FULL_EXPERT_LINEARS = [(rows, n, k, g) for rows in (8192, 32768) for n, k, g in EXPERT_PROJECTIONS]
TINY_EXPERT_LINEARS = [(256, 128, 128, 4)]  # 128-wide: the block recipes need it
RECIPE_OF = {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "block",
             "delayed": "delayed", "mxfp8": "mxfp8"}  # fmt: skip


def _timer(device, tiny: bool = False) -> Callable[[Callable[[], object]], float]:
    import torch

    counts = (1, 2, 1) if tiny else (3, 10, 3)

    def measure(fn: Callable[[], object], warmup: int = counts[0], repeat: int = counts[1],
                trials: int = counts[2]) -> float:  # fmt: skip
        for _ in range(warmup):
            fn()
        results = []
        for _ in range(trials):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                for _ in range(repeat):
                    fn()
                end.record()
                end.synchronize()
                results.append(start.elapsed_time(end) / 1e3 / repeat)
            else:
                t0 = time.perf_counter()
                for _ in range(repeat):
                    fn()
                results.append((time.perf_counter() - t0) / repeat)
        return statistics.median(results)

    return measure


def calibrate(device_name: str = "auto", tiny: bool = False, fp8_recipes=None) -> CalibrationTable:
    """Measure every entry kind (module docstring) and return the table."""
    import torch

    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    label = "bf16"  # the key the cost model looks up: the training GEMM dtype
    timeit = _timer(device, tiny)
    entries: list[Entry] = []
    gemms = TINY_GEMMS if tiny else FULL_GEMMS
    for M, N, K in gemms:
        x = torch.randn(M, K, device=device, dtype=dtype)
        w = torch.randn(N, K, device=device, dtype=dtype)
        dy = torch.randn(M, N, device=device, dtype=dtype)
        for gemm_pass, fn in linear_gemms(x, w, dy).items():
            entries.append(_gemm_entry("gemm", gemm_pass, label, (M, N, K), timeit(fn)))
    # NOTE: off the GPU the block and MX recipes run an exact emulation that takes seconds per
    # GEMM; --tiny measures tensorwise only unless recipes are named
    recipes = fp8_recipes or (["tensorwise"] if tiny else list(RECIPE_OF))
    entries += _fp8_gemms(device, dtype, gemms, timeit, recipes)
    entries += _grouped(device, dtype, label, tiny, timeit)
    entries += _expert_linears(device, tiny, timeit, recipes)
    entries += _attention(device, dtype, label, tiny, timeit)
    entries += _membound(device, dtype, tiny, timeit)
    entries += _host(device, tiny)
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    source = f"mt-plan calibrate on {name}, torch {torch.__version__}" + (" (tiny)" if tiny else "")
    return CalibrationTable(name, entries, source)


def _gemm_entry(
    op: str, gemm_pass: str, dtype: str, linear: tuple[int, ...], seconds: float
) -> Entry:
    """The entry of one pass of the linear ``(M, N, K[, groups])`` timed at ``seconds``."""
    M, N, K, *groups = linear
    flops = 2.0 * M * N * K
    return Entry(f"{op}_{gemm_pass}", dtype, (*gemm_pass_shapes(M, N, K)[gemm_pass], *groups),
                 flops / seconds)  # fmt: skip


def linear_gemms(x_MK, w_NK, dy_MN) -> dict[str, Callable[[], object]]:
    """The three GEMMs autograd runs for ``F.linear(x, w)``: forward on ``w``'s transposed
    view, dgrad ``dy @ w`` on both row-major, wgrad ``dyᵀ @ x`` on ``dy``'s transposed view."""
    import torch
    import torch.nn.functional as F

    return {
        "fwd": lambda: F.linear(x_MK, w_NK),
        "dgrad": lambda: torch.mm(dy_MN, w_NK),
        "wgrad": lambda: torch.mm(dy_MN.t(), x_MK),
    }


def fp8_linear_gemms(recipe, x_MK, dy_MN) -> dict[str, Callable[[], object]]:
    """The three FP8 GEMMs of an ``mt_fp8.FP8Linear`` (fp32 weight) reading ``x`` and ``dy``:
    ``mt_fp8.fp8_gemm`` on the operands ``mt_fp8.functional`` passes it, quantized by the
    layer's own plan (its quantizer dispatch, formats per role, transposes and padding), with
    its output dtypes: the plan's in forward, ``x``'s in dgrad, the weight's (fp32) in wgrad."""
    import mt_fp8
    from mt_fp8 import FP8Linear, TensorRole

    layer = FP8Linear(x_MK.shape[1], dy_MN.shape[1], bias=False, device=x_MK.device,
                      recipe=recipe)  # fmt: skip
    weight_NK = layer.weight.detach()
    plan = layer.linear_plan(x_MK, None)
    x_q = plan.quantize(x_MK, TensorRole.INPUT, record=True, transposed=True)
    w_q, w_t_q = plan.weight_operands(weight_NK, need_transpose=True)
    dy_q = plan.quantize(dy_MN, TensorRole.GRAD_OUTPUT, record=True, transposed=True)
    x_t_q = plan.quantize_transposed(x_MK, x_q, TensorRole.INPUT)
    dy_t_q = plan.quantize_transposed(dy_MN, dy_q, TensorRole.GRAD_OUTPUT)

    def gemm(a, b, out_dtype):
        return mt_fp8.fp8_gemm(a, b, out_dtype, None, plan.backend)

    return {
        "fwd": lambda: gemm(x_q, w_q, plan.out_dtype),
        "dgrad": lambda: gemm(dy_q, w_t_q, x_MK.dtype),
        "wgrad": lambda: gemm(dy_t_q, x_t_q, weight_NK.dtype),
    }


def grouped_gemms(x_MK, w_LNK, dy_MN, offs) -> dict[str, Callable[[], object]]:
    """The three grouped GEMMs autograd runs for ``torch._grouped_mm(x, wᵀ, offs)``, as
    ``GroupedLinear`` calls it on its [experts, out, in] weight: forward on the weights'
    transposed view, dgrad on the weights, wgrad ``dyᵀ·x`` per group (2d × 2d)."""
    import torch

    return {
        "fwd": lambda: torch._grouped_mm(x_MK, w_LNK.transpose(-2, -1), offs=offs),
        "dgrad": lambda: torch._grouped_mm(dy_MN, w_LNK, offs=offs),
        "wgrad": lambda: torch._grouped_mm(dy_MN.t(), x_MK, offs=offs),
    }


def _fp8_gemms(device, dtype, gemms, timeit, recipes) -> list[Entry]:
    import torch

    from mt_fp8 import recipe_from_name

    out = []
    for recipe_name in recipes:
        recipe = recipe_from_name(RECIPE_OF[recipe_name])
        for M, N, K in gemms:
            if K % 128 or M % 128 or N % 128:
                continue  # block recipes need 128-multiples; skip odd shapes for all recipes
            x = torch.randn(M, K, device=device, dtype=dtype)
            dy = torch.randn(M, N, device=device, dtype=dtype)
            for gemm_pass, fn in fp8_linear_gemms(recipe, x, dy).items():
                seconds = timeit(fn)
                out.append(_gemm_entry("gemm", gemm_pass, f"fp8_{recipe_name}", (M, N, K), seconds))
    return out


def _grouped(device, dtype, label, tiny, timeit) -> list[Entry]:
    import torch

    out = []
    for rows, N, K, groups in TINY_GROUPED if tiny else FULL_GROUPED:
        x = torch.randn(rows, K, device=device, dtype=dtype)
        w = torch.randn(groups, N, K, device=device, dtype=dtype)
        dy = torch.randn(rows, N, device=device, dtype=dtype)
        offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (rows // groups)
        gemms = grouped_gemms(x, w, dy, offs)
        try:
            gemms["fwd"]()
        except (RuntimeError, NotImplementedError):
            return out  # this torch/device has no grouped GEMM: the model falls back
        for gemm_pass, fn in gemms.items():
            out.append(_gemm_entry("grouped_gemm", gemm_pass, label, (rows, N, K, groups),
                                   timeit(fn)))  # fmt: skip
    return out


def routed_sizes(rows: int, groups: int) -> list[int]:
    """``groups`` token counts summing to ``rows``, alternately an eighth (odd) above and below
    the mean, so none is a multiple of 16 when the mean is (the grouped wgrad then pads)."""
    mean = rows // groups
    skew = max(mean // 8, 1) | 1
    sizes = [mean + (skew if g % 2 == 0 else -skew) for g in range(groups)]
    sizes[-1] += rows - sum(sizes)
    return sizes


def _expert_linears(device, tiny, timeit, recipes) -> list[Entry]:
    import torch

    from mt_fp8 import FP8GroupedLinear, recipe_from_name
    from mt_parallel import expert_recipe
    from mt_parallel.moe.experts import GroupedLinear

    gpu = device.type == "cuda"
    act_dtype = torch.bfloat16 if gpu else torch.float32
    # NOTE: long calls: a few repeats give a stable median without minutes of device time
    counts = {} if tiny else {"warmup": 2, "repeat": 3}
    out = []
    for name in ["bf16", *recipes]:
        for rows, N, K, groups in TINY_EXPERT_LINEARS if tiny else FULL_EXPERT_LINEARS:
            sizes = routed_sizes(rows, groups)
            if name == "bf16":
                layer = GroupedLinear(groups, K, N, init_std=0.02).to(device)
                group_sizes = torch.tensor(sizes, device=device)
            else:
                recipe = expert_recipe(recipe_from_name(RECIPE_OF[name]))
                layer = FP8GroupedLinear(groups, K, N, bias=False, device=device, recipe=recipe)
                group_sizes = sizes
            x = torch.randn(rows, K, device=device, dtype=act_dtype, requires_grad=True)
            dy = torch.randn(rows, N, device=device, dtype=act_dtype)

            def forward(layer=layer, x=x, group_sizes=group_sizes):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
                    return layer(x, group_sizes)

            def both(layer=layer, x=x, dy=dy, forward=forward):
                layer.weight.grad = x.grad = None  # the step's first micro-batch: no accumulation
                forward().backward(dy)

            fwd = timeit(forward, **counts)
            bwd = max(timeit(both, **counts) - fwd, 1e-9)
            flops = 2.0 * rows * N * K
            dtype = name if name == "bf16" else f"fp8_{name}"
            shape = (rows, N, K, groups)
            out.append(Entry("grouped_linear_fwd", dtype, shape, flops / fwd))
            out.append(Entry("grouped_linear_bwd", dtype, shape, 2 * flops / bwd))
    return out


def _attention(device, dtype, label, tiny, timeit) -> list[Entry]:
    import torch
    import torch.nn.functional as F

    out = []
    for bh, s, d in TINY_ATTENTION if tiny else FULL_ATTENTION:
        q, k, v = (torch.randn(1, bh, s, d, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        flops = bh * (s * s / 2) * 2 * (d + d)  # causal, as mt_plan.cost counts it
        fwd = timeit(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))

        def both(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        bwd = max(timeit(both) - fwd, 1e-9)
        out.append(Entry("attention_fwd", label, (bh, s, d), flops / fwd))
        out.append(Entry("attention_bwd", label, (bh, s, d), 2.5 * flops / bwd))
    return out


def _membound(device, dtype, tiny, timeit) -> list[Entry]:
    import torch

    from mt_fp8 import FP8Format, FusedAdamW
    from mt_fp8.ops import apply_rotary, cross_entropy, quantize_transpose_amax, rms_norm, swiglu

    A = torch.finfo(dtype).bits // 8
    out = []
    # NOTE: each timed call also sums the output, materializes the sum's gradient and
    # accumulates into the leaves' never-cleared .grad; the rates stay per the bytes named
    # below, and mt_plan.calibration.HARNESS_TRAFFIC converts them to the bandwidth achieved
    for rows, cols in TINY_ROWS if tiny else FULL_ROWS:
        x = torch.randn(rows, cols, device=device, dtype=torch.float32, requires_grad=True)
        g = torch.ones(cols, device=device, requires_grad=True)

        def norm(x=x, g=g):
            rms_norm(x, g, out_dtype=dtype).sum().backward()

        # cost model: forward 2·(4+A)·T·D over two norms → (4+A) per norm; backward (8+A)
        out.append(
            Entry("rmsnorm", "bf16", (rows, cols), (12 + 2 * A) * rows * cols / timeit(norm))
        )
        gate = torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True)
        up = torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True)

        def act(gate=gate, up=up):
            swiglu(gate, up).sum().backward()

        out.append(Entry("swiglu", "bf16", (rows, cols), 16 * A * rows * cols / timeit(act)))
        vocab = cols
        logits = torch.randn(rows, vocab, device=device, dtype=dtype, requires_grad=True)
        target = torch.randint(0, vocab, (rows,), device=device)

        def ce(logits=logits, target=target):
            cross_entropy(logits, target).backward()

        out.append(Entry("cross_entropy", "bf16", (rows, vocab), 6 * A * rows * vocab / timeit(ce)))
        plain = torch.randn(rows, cols, device=device, dtype=dtype)
        quant = timeit(lambda plain=plain: quantize_transpose_amax(plain, FP8Format.E4M3))
        out.append(Entry("quantize", "bf16", (rows, cols), (A + 2) * rows * cols / quant))
        copy_to = torch.empty_like(plain)
        copied = timeit(lambda plain=plain, copy_to=copy_to: copy_to.copy_(plain))
        out.append(Entry("copy", "bf16", (rows, cols), 2 * A * rows * cols / copied))
    heads, hd = (2, 32) if tiny else (32, 128)
    seq = 64 if tiny else 8192
    q = torch.randn(1, seq, heads, hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, seq, heads // 4 or 1, hd, device=device, dtype=dtype, requires_grad=True)
    angles = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * torch.ones(
        hd // 2, device=device
    )
    cos, sin = angles.cos(), angles.sin()

    def rope(q=q, k=k):
        qr, kr = apply_rotary(q, k, cos, sin)
        (qr.sum() + kr.sum()).backward()

    width = (q.shape[2] + k.shape[2]) * hd
    out.append(Entry("rope", "bf16", (seq, width), 2 * 2 * A * seq * width / timeit(rope)))
    numel = 4096 if tiny else 256 * 2**20
    param = torch.nn.Parameter(torch.randn(numel, device=device))
    param.grad = torch.randn(numel, device=device)
    opt = FusedAdamW([param], lr=1e-4)
    out.append(Entry("adamw", "fp32", (numel,), 28 * numel / timeit(opt.step)))
    return out


def _host(device, tiny: bool) -> list[Entry]:
    """Seconds per kernel launch and per host read (module docstring, "Host costs")."""
    import torch

    launches, reads, trials = (64, 16, 3) if tiny else (1000, 200, 7)
    x = torch.zeros(16, device=device)
    sizes = torch.arange(8, device=device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def per_event(fn: Callable[[], object], count: int) -> float:
        results = []
        for _ in range(trials + 1):  # the first warms up
            synchronize()
            start = time.perf_counter()
            for _ in range(count):
                fn()
            results.append((time.perf_counter() - start) / count)
            synchronize()
        return statistics.median(results[1:])

    launch = per_event(lambda: x.add_(1.0), launches)
    read = per_event(sizes.tolist, reads)
    return [
        Entry("kernel_launch", "none", (launches,), 1.0 / launch),
        Entry("host_read", "none", (reads,), 1.0 / read),
    ]
