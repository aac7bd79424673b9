"""The FP8 MoE layer's work does not grow with the number of experts: aten ops and host reads
of one forward + backward at E=4 and E=32, with the grouped FP8 path forced on the CPU (its
device check passed, the grouped kernel replaced by a one-op stand-in: the operands around it
are what count) and routed group sizes that are not multiples of 16. Under block scaling the
grouped path reads the group sizes on the device: no host read beyond the bf16 layer's."""

from __future__ import annotations

import collections
import functools
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mt_fp8
import mt_fp8.grouped as grouped_module
import mt_fp8.linear as linear_module
import mt_parallel as mp
from mt_parallel.moe import GroupedExperts, MoE, MoEConfig

DIM = 32  # a multiple of 16: the grouped kernel's K and N
HOST_READS = ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default")


def one_op_grouped_mm(a, b, scale_a, scale_b, offs):
    """A stand-in for ``torch._scaled_grouped_mm`` that dispatches one op."""
    if b.dim() == 3:
        return a.new_zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16)
    return a.new_zeros(len(offs), a.shape[0], b.shape[1], dtype=torch.bfloat16)


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def grouped_fp8_on_cpu(monkeypatch):
    monkeypatch.setattr(grouped_module, "_device_reason", lambda device: None)
    fast = functools.partial(grouped_module.fp8_grouped_linear, grouped_gemm=one_op_grouped_mm)
    monkeypatch.setattr(linear_module, "fp8_grouped_linear", fast)
    tolist_calls = []
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        tolist_calls.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    return tolist_calls


def layer_counts(
    experts: int,
    tolist_calls: list[int],
    fp8: bool = True,
    recipe: mt_fp8.Recipe | None = None,
    width: int = DIM,
) -> tuple[int, int]:
    """(aten ops, host reads) of one forward + backward of an MoE layer with ``experts``, in
    FP8 with ``recipe`` (default: all-E4M3 rowwise) and of ``width`` (model and expert FFN)."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=experts, top_k=2, expert_ffn_dim=width, balancing="none")
    layer = MoE(width, cfg).to(torch.bfloat16)
    if fp8:
        rowwise = mt_fp8.RowwiseScaling(formats=mt_fp8.FormatConfig.all_e4m3())
        mp.apply_fp8(layer, rowwise if recipe is None else recipe)
    x = torch.randn(2, 40, width, dtype=torch.bfloat16, requires_grad=True)
    tolist_calls.clear()
    counter = OpCount()
    with counter:
        layer(x).sum().backward()
    host_reads = len(tolist_calls) + sum(counter.ops[name] for name in HOST_READS)
    sizes = layer.load_stats.counts_E.tolist()
    assert any(size % 16 for size in sizes)  # the grouped wgrad pads these groups
    assert layer.experts.down_proj.weight.grad is not None and x.grad is not None
    return sum(counter.ops.values()), host_reads


def test_fp8_moe_layer_work_does_not_grow_with_the_number_of_experts(grouped_fp8_on_cpu):
    ops_4, reads_4 = layer_counts(4, grouped_fp8_on_cpu)
    ops_32, reads_32 = layer_counts(32, grouped_fp8_on_cpu)
    assert ops_4 == ops_32
    assert reads_4 == reads_32
    # All-E4M3 rowwise experts (every GEMM grouped) read the group sizes on the device: no
    # host read beyond the bf16 layer's.
    _, bf16_reads = layer_counts(32, grouped_fp8_on_cpu, fp8=False)
    assert reads_32 == bf16_reads


def one_op_block_mm(a, scale_a, b, scale_b, tiles, out_dtype, *args):
    """A stand-in for the grouped block GEMM (2d × 3d) that dispatches one op."""
    return a.new_zeros(a.shape[0], b.shape[1], dtype=out_dtype)


def one_op_k_grouped_block_mm(a, scale_a, b, scale_b, starts, out_dtype, *args):
    """A stand-in for the k-grouped block GEMM (wgrad) that dispatches one op."""
    return a.new_zeros(starts.numel() - 1, a.shape[0], b.shape[0], dtype=out_dtype)


def test_fp8_block_moe_layer_reads_the_group_sizes_on_the_device(grouped_fp8_on_cpu, monkeypatch):
    """The grouped block path forced on the CPU (its device check passed, its two GEMMs one-op
    stand-ins): GroupedExperts hands it the router's counts as a tensor, so the FP8 layer reads
    no more from the device than the bf16 one (the per-MLP read of the counts is gone), and its
    ops do not grow with E (16 and 32 experts: the block path's smallest under "auto")."""
    pytest.importorskip("triton")
    from mt_fp8.kernels import grouped_block_gemm

    monkeypatch.setattr(grouped_module, "_block_reason", lambda x, weight, recipe: None)
    monkeypatch.setattr(grouped_block_gemm, "grouped_block_mm", one_op_block_mm)
    monkeypatch.setattr(grouped_block_gemm, "k_grouped_block_mm", one_op_k_grouped_block_mm)
    recipe = mt_fp8.BlockScaling()
    ops_16, reads_16 = layer_counts(16, grouped_fp8_on_cpu, recipe=recipe, width=128)
    ops_32, reads_32 = layer_counts(32, grouped_fp8_on_cpu, recipe=recipe, width=128)
    _, bf16_reads = layer_counts(32, grouped_fp8_on_cpu, fp8=False, width=128)
    assert ops_16 == ops_32
    assert reads_16 == reads_32 == bf16_reads


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 (the grouped block GEMMs run in Triton's interpreter)",
)
def test_fp8_block_experts_on_device_sizes_give_the_host_sizes_bits(
    grouped_fp8_on_cpu, monkeypatch
):
    """The expert MLP on the grouped block path (forced on the CPU, real kernels interpreted)
    reads no counts to the host and gives what it gives when GroupedExperts reads them first:
    output and every gradient bit for bit, an idle expert included."""
    monkeypatch.setenv("MT_FP8_DISABLE_TRITON", "1")  # PyTorch quantizers (the same bits)
    monkeypatch.setattr(grouped_module, "_block_reason", lambda x, weight, recipe: None)
    torch.manual_seed(0)
    experts = GroupedExperts(16, 128, 128, 128**-0.5, 128**-0.5)
    mp.apply_fp8(experts, mt_fp8.BlockScaling())
    sizes = [9, 0, 30, 1, 12, 0, 7, 20, 3, 0, 15, 5, 11, 2, 0, 4]
    x = torch.randn(sum(sizes), 128)
    dy = torch.randn(sum(sizes), 128, dtype=torch.bfloat16)

    def run() -> list[torch.Tensor]:
        experts.zero_grad(set_to_none=True)
        x_leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = experts(x_leaf, torch.tensor(sizes))
        y.backward(dy)
        return [y, x_leaf.grad, *(p.grad for p in experts.parameters())]

    grouped_fp8_on_cpu.clear()
    on_device = run()
    assert grouped_fp8_on_cpu == []  # no tolist: the counts stayed where they were
    monkeypatch.setattr(mt_fp8.FP8GroupedLinear, "reads_sizes_on_device", lambda self, x_TK: False)
    on_host = run()
    assert grouped_fp8_on_cpu == [16]
    for a, b in zip(on_device, on_host, strict=True):
        assert torch.equal(a, b)
    assert not on_device[2][1].any()  # the idle expert's gate weight gradient
