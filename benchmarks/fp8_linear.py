"""FP8Linear fwd+bwd time per recipe vs torchao Float8Linear and bf16 nn.Linear (Llama3-8B shapes).

Run on a CUDA GPU: ``python benchmarks/fp8_linear.py`` (torchao optional: its columns are
skipped when it is not importable). Times are medians of CUDA-event timings
(``harness.median_ms``) of ``y = layer(x); y.backward(dy)`` with bf16 parameters and
activations, tokens M = 8192. Every iteration is one training step with one micro-batch: the gradients are cleared before it
and the input's version counter is bumped (both untimed), and our layers re-quantize the weight
(``cache_weight=False``) and the input, as torchao does. In ``compiled`` mode our layers run
eagerly behind ``torch.compile``'s wrapper (``FP8Linear.forward`` is kept out of compiled graphs:
:mod:`mt_fp8.linear`), while torchao's are compiled. In ``graphed`` mode every stack's step
(compiled for bf16 and torchao, eager for ours) is captured once as a CUDA graph and the graph's
replays are timed: the GPU's time for the kernels with no host launch cost, the cost that
dominates a single layer's eager step (``docs/benchmarks-log.md``), as the trainer's
``trainer.cuda_graph`` runs it.
"""

from __future__ import annotations

import argparse
import copy

import harness
import torch
from torch import nn

from mt_fp8 import (
    BlockScaling,
    DelayedScaling,
    FormatConfig,
    FP8Linear,
    MXFP8Scaling,
    RowwiseScaling,
    TensorwiseScaling,
    update_fp8_scales,
)

M = 8192
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N)
# (column label, recipe, GEMM backend); "block_e4m3" is DeepSeek-V3's all-E4M3 block recipe,
# whose gradient GEMMs cuBLAS runs (the hybrid E5M2 gradients go to the Triton block GEMM).
# "mxfp8" takes the exact bf16 GEMM (backend "auto" on Hopper), "mxfp8_triton" the Triton 1x32
# kernel it replaced.
RECIPES = [
    ("tensorwise", TensorwiseScaling(), "auto"),
    ("rowwise", RowwiseScaling(), "auto"),
    ("delayed", DelayedScaling(), "auto"),
    ("block", BlockScaling(), "auto"),
    ("block_e4m3", BlockScaling(formats=FormatConfig.all_e4m3()), "auto"),
    ("mxfp8", MXFP8Scaling(), "auto"),
    ("mxfp8_triton", MXFP8Scaling(), "triton"),
]
COMPILED = ("tensorwise", "rowwise")  # compile time budget: the recipes torchao also has


def time_ms(
    layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, iters: int = 10, graphed: bool = False
) -> float:
    def clear_grads() -> None:
        x.grad = None
        for parameter in layer.parameters():
            parameter.grad = None
        # A new input each step, as in training: the FP8 layers keep the last input's FP8 copy
        # (keyed on its version counter) and would otherwise skip quantizing x.
        with torch.no_grad():
            x.add_(0)

    def step() -> None:
        layer(x).backward(dy)

    if not graphed:
        return harness.median_ms(step, repeats=iters, warmup=3, before=clear_grads)
    for _ in range(3):
        clear_grads()
        step()
    # Gradients allocated by the capture and overwritten by each replay; x's fresh version
    # makes our layers record x's quantization.
    clear_grads()
    graph = harness.capture_graph(step)
    return harness.median_ms(graph.replay, repeats=iters, warmup=0)


def torchao_layer(linear: nn.Linear, recipe_name: str) -> nn.Module | None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    wrapper = nn.Sequential(copy.deepcopy(linear))
    convert_to_float8_training(wrapper, config=Float8LinearConfig.from_recipe_name(recipe_name))
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--modes",
        default="eager,compiled",
        help="comma-separated: eager, compiled, graphed (default eager,compiled)",
    )
    modes = parser.parse_args().modes.split(",")
    harness.require_cuda()
    torch.manual_seed(0)
    torch._dynamo.config.cache_size_limit = 64
    print(
        f"# {torch.cuda.get_device_name()} torch {torch.__version__}, M={M}, bf16, fwd+bwd ms (median of 10)"
    )
    print(
        "| K x N | mode | bf16 | "
        + " | ".join(f"ours {label}" for label, _, _ in RECIPES)
        + " | torchao tensorwise | torchao rowwise |"
    )
    print("|" + " --- |" * (5 + len(RECIPES)))
    for k, n in SHAPES:
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
        base = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        for mode in modes:
            graphed = mode == "graphed"
            wrap = (lambda m: torch.compile(m)) if mode != "eager" else (lambda m: m)
            row = [time_ms(wrap(base), x, dy, graphed=graphed)]
            for label, recipe, backend in RECIPES:
                if mode == "compiled" and label not in COMPILED:
                    row.append(float("nan"))
                    continue
                try:
                    layer = FP8Linear.from_linear(base, recipe=recipe, backend=backend)
                    layer.cache_weight = False
                    if isinstance(recipe, DelayedScaling):
                        layer(x).backward(dy)
                        update_fp8_scales(layer, recipe)
                    ours = layer if graphed else wrap(layer)
                    row.append(time_ms(ours, x, dy, graphed=graphed))
                except Exception as error:  # report, keep measuring the others
                    message = f"{type(error).__name__}: {str(error)[:200]}"
                    print(f"<!-- {label} {mode} {k}x{n} failed: {message} -->")
                    row.append(float("nan"))
            for name in ("tensorwise", "rowwise"):
                ao = torchao_layer(base, name)
                row.append(
                    float("nan") if ao is None else time_ms(wrap(ao), x, dy, graphed=graphed)
                )
            print(f"| {k}x{n} | {mode} | " + " | ".join(f"{t:.3f}" for t in row) + " |")


if __name__ == "__main__":
    main()
