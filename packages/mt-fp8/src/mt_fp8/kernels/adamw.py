"""Triton AdamW update: one pass over parameters, their gradients and both moments, all
tensors of one dtype combination in one launch.

For each element of tensor ``i``, with its step's host-computed scalars ``decay = 1 - lr·λ``,
``step_size = lr / (1 - β₁ᵗ)`` and ``bc2_sqrt = √(1 - β₂ᵗ)`` (and its group's ``β₁, β₂, ε``), and
the optional device scalar ``grad_scale`` (the gradient is divided by it: the clip coefficient's
reciprocal, or a loss scale)::

    g  = grad / grad_scale
    θ  = θ · decay
    m  = β₁·m + (1 - β₁)·g
    v  = β₂·v + (1 - β₂)·g²
    θ  = θ - step_size · m / (√v / bc2_sqrt + ε)

which is ``torch.optim.AdamW``'s update in the order its fused CUDA kernel applies it
(arithmetic in fp32; parameters and moments stored in their own dtype). The pass reads
θ, g, m, v and writes θ, m, v: 28 bytes per fp32 element, the least an unfused-state AdamW can
move. The gradient is not written back (PyTorch's fused kernel stores the unscaled gradient when
given a scale).

One launch for many tensors: each program updates ``BLOCK`` elements of one tensor. Two int32
tables map a program to its tensor and to its block within that tensor; they depend only on
the tensors' sizes and are built once and kept. Per step the host uploads the tensors' addresses
(int64, read in the kernel as pointers) and their six fp32 scalars: two small host-to-device
copies from pageable memory, queued without waiting for the device. NOTE: one launch per
parameter, as before, left the H200 idle for 1.2 ms before the 75 launches of the 8-layer
Llama3-8B step (seq 4096 profile, ``docs/benchmarks.md`` session 12): the small tensors (norm
gains) finish faster than the host issues the next launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A sweep on the H200 (2026-12-03, 2.8 B fp32 elements, 75 tensors, one launch each): 1024
# elements and 4 warps per program took 18.9 ms (4.14 TB/s, 97% of the measured copy
# bandwidth); 4096 × 8 took 19.3, 8192 × 8 26.9; PyTorch's fused AdamW with a grad_scale 26.5.
BLOCK = 1024
WARPS = 4
SCALARS = 6
"""Per-tensor fp32 scalars, in this order: decay, step_size, bc2_sqrt, β₁, β₂, ε."""


@triton.jit
def _adamw(
    param_0_ptr,
    grad_0_ptr,
    exp_avg_0_ptr,
    exp_avg_sq_0_ptr,
    addresses_ptr,
    numels_ptr,
    scalars_ptr,
    block_tensor_ptr,
    block_index_ptr,
    grad_scale_ptr,
    tensors,
    HAS_GRAD_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALARS: tl.constexpr,
):
    # The *_0 pointers are the first tensor of each list: they only fix the element types.
    tensor = tl.load(block_tensor_ptr + tl.program_id(0))
    block = tl.load(block_index_ptr + tl.program_id(0))
    param_ptr = tl.load(addresses_ptr + tensor).to(tl.pointer_type(param_0_ptr.dtype.element_ty))
    grad_ptr = tl.load(addresses_ptr + tensors + tensor).to(
        tl.pointer_type(grad_0_ptr.dtype.element_ty)
    )
    exp_avg_ptr = tl.load(addresses_ptr + 2 * tensors + tensor).to(
        tl.pointer_type(exp_avg_0_ptr.dtype.element_ty)
    )
    exp_avg_sq_ptr = tl.load(addresses_ptr + 3 * tensors + tensor).to(
        tl.pointer_type(exp_avg_sq_0_ptr.dtype.element_ty)
    )
    decay = tl.load(scalars_ptr + SCALARS * tensor)
    step_size = tl.load(scalars_ptr + SCALARS * tensor + 1)
    bc2_sqrt = tl.load(scalars_ptr + SCALARS * tensor + 2)
    beta1 = tl.load(scalars_ptr + SCALARS * tensor + 3)
    beta2 = tl.load(scalars_ptr + SCALARS * tensor + 4)
    eps = tl.load(scalars_ptr + SCALARS * tensor + 5)
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels_ptr + tensor)
    param = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    grad = grad.to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_SCALE:
        grad = grad / tl.load(grad_scale_ptr)
    param = param * decay
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bc2_sqrt + eps
    param = param - step_size * exp_avg / denom
    tl.store(param_ptr + offs, param.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offs, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


class BlockTables:
    """The program → (tensor, block) tables of one list of tensor sizes (module docstring),
    kept for the next call with the same sizes on the same device."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def get(
        self, numels: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(numels int64 [T], block_tensor int32 [P], block_index int32 [P])`` on ``device``."""
        key = (device, tuple(numels), BLOCK)
        if self._key != key or self._tables is None:
            counts = torch.tensor([triton.cdiv(n, BLOCK) for n in numels], dtype=torch.int64)
            firsts = torch.cumsum(counts, 0) - counts
            block_tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
            block_index = torch.arange(int(counts.sum())) - firsts[block_tensor]
            self._tables = (
                torch.tensor(numels, dtype=torch.int64).to(device),
                block_tensor.to(device, torch.int32),
                block_index.to(device, torch.int32),
            )
            self._key = key
        return self._tables


def adamw_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    scalars: list[tuple[float, float, float, float, float, float]],
    grad_scale: torch.Tensor | None,
    tables: BlockTables,
) -> None:
    """Update every ``params[i]``, ``exp_avgs[i]``, ``exp_avg_sqs[i]`` in place in one launch.

    All on one device, contiguous; each list of one dtype; ``grads[i]`` and the moments shaped
    like ``params[i]``; ``scalars[i]`` as :data:`SCALARS` says.
    """
    numels = [p.numel() for p in params]
    if sum(numels) == 0:
        return
    device = params[0].device
    numels_t, block_tensor, block_index = tables.get(numels, device)
    # Uploaded per step: addresses can change (gradients are new tensors every step). From
    # pageable memory, non_blocking: staged on the host and queued, without a device wait.
    addresses = torch.tensor(
        [[t.data_ptr() for t in tensors] for tensors in (params, grads, exp_avgs, exp_avg_sqs)],
        dtype=torch.int64,
    ).to(device, non_blocking=True)
    scalars_t = torch.tensor(scalars, dtype=torch.float32).to(device, non_blocking=True)
    _adamw[(block_tensor.numel(),)](
        params[0],
        grads[0],
        exp_avgs[0],
        exp_avg_sqs[0],
        addresses,
        numels_t,
        scalars_t,
        block_tensor,
        block_index,
        grad_scale if grad_scale is not None else scalars_t,
        len(params),
        HAS_GRAD_SCALE=grad_scale is not None,
        BLOCK=BLOCK,
        SCALARS=SCALARS,
        num_warps=WARPS,
    )
