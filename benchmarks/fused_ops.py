"""Fused ops (fwd+bwd) vs eager PyTorch, torch.compile and liger-kernel, as GB/s and % of copy BW.

Run on a CUDA GPU: ``python benchmarks/fused_ops.py`` (liger-kernel optional). Bytes counted are
the minimum each op must move through autograd, forward + backward, in bf16:
RMSNorm(R×D): fwd read x, write y; bwd read dy, x, write dx → 5·R·D·2 bytes.
SwiGLU(R×F): fwd read g, u, write y; bwd read dy, g, u, write dg, du → 8·R·F·2.
RoPE(q, k): fwd read+write q, k; bwd the same → 4·(|q|+|k|)·2.
Cross-entropy(R×V): fwd read logits; bwd read logits, write grad → 3·R·V·2.
Copy bandwidth: a device-to-device copy of 4 GiB, counting read + write.

Two times per op and implementation:

* **device**: the summed GPU time of the kernels of one forward + backward (PyTorch profiler,
  mean over 10 steps: ``harness.kernel_ms``). In a training step the host queues work ahead of
  the GPU, so this is what the op costs the step; the bandwidth targets are judged on it.
* **wall**: CUDA-event time of one forward + backward issued from an idle queue (median of 10:
  ``harness.median_ms``), so it also contains the host's launch overhead (autograd, Python,
  kernel launch); for small ops this dominates and says nothing about the kernels.
"""

from __future__ import annotations

import argparse

import harness
import torch
import torch.nn.functional as F

from mt_fp8.ops import apply_rotary, cross_entropy, rms_norm, swiglu
from mt_fp8.ops.rope import rope_tables


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy of 4 GiB of bf16, read + write."""
    return harness.copy_gbps(2**31) * 1e9


def eager_rms(x, w):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(
        x.dtype
    )


def eager_rope(q, k, cos, sin):
    def rot(x):
        x1, x2 = x.float().chunk(2, -1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)

    return rot(q), rot(k)


def liger():
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return {
        "rmsnorm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6),
        "swiglu": lambda g, u: LigerSiLUMulFunction.apply(g, u),
        "cross_entropy": lambda z, t: LigerCrossEntropyFunction.apply(z, t, None)[0],
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    harness.require_cuda()
    bandwidth = copy_bandwidth()
    print(
        f"# {torch.cuda.get_device_name()} torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s"
    )
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(8192, 4096, device=dev, dtype=bf16, requires_grad=True)
    w = torch.ones(4096, device=dev, dtype=bf16, requires_grad=True)
    g = torch.randn(8192, 14336, device=dev, dtype=bf16, requires_grad=True)
    u = torch.randn(8192, 14336, device=dev, dtype=bf16, requires_grad=True)
    q = torch.randn(1, 8192, 32, 128, device=dev, dtype=bf16, requires_grad=True)
    k = torch.randn(1, 8192, 8, 128, device=dev, dtype=bf16, requires_grad=True)
    cos, sin = rope_tables(8192, 128, device=dev)
    z = torch.randn(8192, 128256, device=dev, dtype=bf16, requires_grad=True)
    t = torch.randint(0, 128256, (8192,), device=dev)
    ops = {
        "rmsnorm": (rms_norm, eager_rms, (x, w), 5 * x.numel() * 2),
        "swiglu": (swiglu, lambda a, b: F.silu(a) * b, (g, u), 8 * g.numel() * 2),
        "rope": (apply_rotary, eager_rope, (q, k, cos, sin), 4 * (q.numel() + k.numel()) * 2),
        "cross_entropy": (
            cross_entropy,
            lambda a, b: F.cross_entropy(a.float(), b),
            (z, t),
            3 * z.numel() * 2,
        ),
    }
    others = liger() or {}
    print(
        "GB/s as device (wall); see the docstring. Last column: ours, device time, "
        "against copy bandwidth."
    )
    print("| op | ours | eager | torch.compile | liger-kernel | ours % of copy BW |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (ours, eager, args, nbytes) in ops.items():

        def run(fn, args=args):
            inputs = [a for a in args if a.requires_grad]
            upstream = None

            def step():
                nonlocal upstream
                out = fn(*args)
                out = out if isinstance(out, tuple) else (out,)
                if upstream is None:
                    upstream = [torch.ones_like(o) for o in out]
                # autograd.grad: no accumulation into .grad, so only the op's own traffic counts.
                torch.autograd.grad(out, inputs, upstream)

            return step

        candidates = {
            "ours": ours,
            "eager": eager,
            "compile": torch.compile(eager),
            "liger": others.get(name),
        }
        device_rates, wall_rates = {}, {}
        for label, fn in candidates.items():
            device_rates[label] = wall_rates[label] = float("nan")
            if fn is None:
                continue
            try:
                fwd_bwd = run(fn)
                device_rates[label] = nbytes / (harness.kernel_ms(fwd_bwd) / 1e3)
                wall_rates[label] = nbytes / (harness.median_ms(fwd_bwd) / 1e3)
            except Exception as error:
                print(f"<!-- {name} {label} failed: {type(error).__name__}: {str(error)[:200]} -->")
        print(
            f"| {name} | "
            + " | ".join(
                f"{device_rates[c] / 1e9:.0f} ({wall_rates[c] / 1e9:.0f})" for c in candidates
            )
            + f" | {100 * device_rates['ours'] / bandwidth:.0f}% |"
        )


if __name__ == "__main__":
    main()
