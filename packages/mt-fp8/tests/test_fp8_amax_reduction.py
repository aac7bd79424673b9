"""Current tensorwise scaling with the amax MAX-reduced over a 2-process gloo group.

One spawn for the module: each rank runs every scenario and saves its results; the tests compare
them with single-process quantizations of the whole tensor. FP8 data travels as ``uint8`` (gloo
carries no FP8 dtypes); amaxes travel as fp32.

What must hold: with the reduction, each rank's FP8 bytes are exactly its slice of the unsharded
tensor's quantization and every rank holds the unsharded scale. Then a column-parallel FP8Linear
split over the ranks multiplies exactly the FP8 operands the unsharded layer multiplies, so its
outputs differ from the unsharded layer's only by fp32 summation order (bounded below).

The same spawn runs delayed scaling's reduction (test_fp8_delayed.py's subject, here to save a
second start of two ranks): ``update_fp8_scales`` MAX-reduces each rank's amax history over the
group ``fp8_autocast`` recorded, so both ranks reach the same scales.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mt_fp8 import (
    ROWWISE,
    DelayedScaling,
    FP8Format,
    FP8Linear,
    TensorRole,
    TensorwiseScaling,
    fp8_autocast,
    quantize,
    update_fp8_scales,
)
from mt_fp8.ops import quantize_transpose_amax

WORLD = 2
M, K, N = 64, 128, 256  # tokens, in_features, out_features (N split over the ranks)


def full_tensors() -> dict[str, torch.Tensor]:
    """The unsharded tensors, identical on every rank and in the test process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=generator)
    x[M // 2 :] *= 5  # the row halves (and so the ranks' shards) have different amaxes
    weight = torch.randn(N, K, generator=generator) / K**0.5
    weight[N // 2 :] *= 3
    dy = torch.randn(M, N, generator=generator)
    dy[:, : N // 2] *= 7
    return {"x": x, "weight": weight, "dy": dy}


def gather_bytes(data: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather FP8 ``data`` as uint8 (gloo has no FP8 dtypes) and concatenate along ``dim``."""
    raw = data.view(torch.uint8).contiguous()
    pieces = [torch.empty_like(raw) for _ in range(WORLD)]
    dist.all_gather(pieces, raw)
    return torch.cat(pieces, dim=dim)


def column_parallel_run(rank: int, roles: tuple[TensorRole, ...]) -> dict[str, torch.Tensor]:
    """A column-parallel FP8Linear: rank r holds weight rows (and dy columns) of half r."""
    t = full_tensors()
    rows = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
    recipe = TensorwiseScaling()
    layer = FP8Linear(
        K, N // WORLD, False, recipe=recipe, backend="emulate", amax_reduction_roles=roles
    )
    with torch.no_grad():
        layer.weight.copy_(t["weight"][rows])
    x = t["x"].clone().requires_grad_()
    with fp8_autocast(amax_group=dist.group.WORLD):
        y = layer(x)
        y.backward(t["dy"][:, rows])
    weight_q = layer.fp8_weight_cache.entry.weight
    return {
        "y": y.detach(),
        "dx_partial": x.grad,
        "dw": layer.weight.grad,
        "weight_scale": weight_q.scale,
        "weight_bytes": gather_bytes(weight_q.data, 0),
    }


def delayed_scaling_run(rank: int) -> dict[str, torch.Tensor]:
    """Delayed scaling on two ranks: each records its own amaxes, the update reduces them."""
    torch.manual_seed(0)  # same weights on both ranks
    recipe = DelayedScaling(amax_history_len=2)
    layer = FP8Linear(64, 32, recipe=recipe)
    generator = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(16, 64, generator=generator) * (rank + 1)  # rank 1 has the larger amax
    dy = torch.randn(16, 32, generator=generator) / (rank + 1)  # rank 0 has the larger amax
    with fp8_autocast(amax_group=dist.group.WORLD):
        layer(x).backward(dy)
    local = layer.fp8_meta.amax_history[0].clone()
    update_fp8_scales(layer, recipe)  # reduces over the group recorded by fp8_autocast
    return {"local": local, "scale": layer.fp8_meta.scale.clone()}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        group = dist.group.WORLD
        t = full_tensors()
        out: dict[str, object] = {}
        for fmt in (FP8Format.E4M3, FP8Format.E5M2):
            x_rows = t["x"].chunk(WORLD, dim=0)[rank]
            x_cols = t["x"].chunk(WORLD, dim=1)[rank]
            reduced_rows = quantize(x_rows, fmt, amax_group=group)
            reduced_cols = quantize(x_cols, fmt, amax_group=group)
            fused, fused_t, amax = quantize_transpose_amax(x_rows, fmt, amax_group=group)
            out[fmt.value] = {
                "rows_bytes": gather_bytes(reduced_rows.data, 0),
                "rows_scale": reduced_rows.scale,
                "cols_bytes": gather_bytes(reduced_cols.data, 1),
                "cols_scale": reduced_cols.scale,
                "fused_bytes": gather_bytes(fused.data, 0),
                "fused_t_bytes": gather_bytes(fused_t.data, 1),
                "fused_scale": fused.scale,
                "fused_amax": amax,
                "local_scale": quantize(x_rows, fmt).scale,
            }
        out["column_parallel"] = column_parallel_run(rank, tuple(TensorRole))
        out["column_parallel_local"] = column_parallel_run(rank, ())
        # NaN on one rank only: every rank must end up with a NaN scale (sent as +inf).
        poisoned = t["x"].chunk(WORLD, dim=0)[rank].clone()
        if rank == 1:
            poisoned[0, 0] = math.nan
        out["nan_scale"] = quantize(poisoned, FP8Format.E4M3, amax_group=group).scale
        out["nan_fused_scale"] = quantize_transpose_amax(
            poisoned, FP8Format.E4M3, amax_group=group
        )[0].scale
        out["delayed"] = delayed_scaling_run(rank)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.mark.parametrize("fmt", [FP8Format.E4M3, FP8Format.E5M2], ids=lambda f: f.value)
def test_shards_quantize_exactly_as_the_whole_tensor(results, fmt):
    x = full_tensors()["x"]
    whole = quantize(x, fmt)
    whole_bytes = whole.data.view(torch.uint8)
    for rank_result in results:
        r = rank_result[fmt.value]
        assert torch.equal(r["rows_bytes"], whole_bytes)  # row shards
        assert torch.equal(r["cols_bytes"], whole_bytes)  # column shards
        assert torch.equal(r["fused_bytes"], whole_bytes)  # quantize_transpose_amax
        assert torch.equal(r["fused_t_bytes"], whole.data.t().contiguous().view(torch.uint8))
        for key in ("rows_scale", "cols_scale", "fused_scale"):
            assert torch.equal(r[key], whole.scale), key
        assert r["fused_amax"] == x.abs().max()
    # Without the reduction the two ranks' scales differ (the halves' amaxes differ by 5x):
    # the reduction is what makes the shards agree.
    assert not torch.equal(
        results[0][fmt.value]["local_scale"], results[1][fmt.value]["local_scale"]
    )


def test_column_parallel_layer_matches_the_unsharded_layer(results):
    t = full_tensors()
    layer = FP8Linear(K, N, bias=False, recipe=TensorwiseScaling(), backend="emulate")
    with torch.no_grad():
        layer.weight.copy_(t["weight"])
    x = t["x"].clone().requires_grad_()
    y = layer(x)
    y.backward(t["dy"])
    whole_w = layer.fp8_weight_cache.entry.weight
    for rank_result in results:
        r = rank_result["column_parallel"]
        assert torch.equal(r["weight_bytes"], whole_w.data.view(torch.uint8))
        assert torch.equal(r["weight_scale"], whole_w.scale)
    # Same FP8 operands on both sides: only fp32 summation order differs, |error| <= n·2^-24·Σ|a'b'|
    # with n the summation length (K for y, M for dw, N/2 per rank plus one addition for dx) and
    # a', b' the dequantized operands; Σ|a'b'| <= 1.5·Σ|ab| since the quantized magnitudes exceed
    # the originals by at most 2^-3 (E5M2) and 2^-4 (E4M3) relative: (1 + 2^-3)(1 + 2^-4) < 1.2.
    halves = [r["column_parallel"] for r in results]
    x64, w64, dy64 = t["x"].double(), t["weight"].double(), t["dy"].double()
    y_bound = K * 2**-24 * (x64.abs() @ w64.abs().t()) * 1.5
    assert ((torch.cat([h["y"] for h in halves], 1) - y).abs() <= y_bound).all()
    dw_bound = M * 2**-24 * (dy64.abs().t() @ x64.abs()) * 1.5
    assert ((torch.cat([h["dw"] for h in halves], 0) - layer.weight.grad).abs() <= dw_bound).all()
    dx_bound = (N + 1) * 2**-24 * (dy64.abs() @ w64.abs()) * 1.5
    assert ((sum(h["dx_partial"] for h in halves) - x.grad).abs() <= dx_bound).all()
    # With no role reduced each rank scales its weight shard by its own amax (3x apart here).
    local = [r["column_parallel_local"]["weight_scale"] for r in results]
    assert not torch.equal(local[0], local[1])


def test_nan_on_one_rank_reaches_every_rank(results):
    for rank_result in results:
        assert rank_result["nan_scale"].isnan().all()
        assert rank_result["nan_fused_scale"].isnan().all()


def test_amax_is_max_reduced_across_two_gloo_ranks(results):
    # Delayed scaling (moved here from test_fp8_delayed.py to share this module's spawn).
    rank0, rank1 = (r["delayed"] for r in results)
    assert not torch.equal(rank0["local"], rank1["local"])
    global_amax = torch.maximum(rank0["local"], rank1["local"])
    fmt_max = torch.tensor([FP8Format.E4M3.max, FP8Format.E4M3.max, FP8Format.E5M2.max])
    assert torch.equal(rank0["scale"], rank1["scale"])
    assert torch.allclose(rank0["scale"], global_amax / fmt_max, rtol=1e-6)


def test_amax_group_is_refused_where_it_has_no_meaning():
    x = torch.randn(8, 16)
    group = object()  # never used: the checks run before any collective
    with pytest.raises(ValueError, match="current tensorwise scaling; got layout rowwise"):
        quantize(x, FP8Format.E4M3, layout=ROWWISE, amax_group=group)
    with pytest.raises(ValueError, match="a given scale"):
        quantize(x, FP8Format.E4M3, scale=torch.tensor(1.0), amax_group=group)
    with pytest.raises(ValueError, match="a scale was given"):
        quantize_transpose_amax(x, FP8Format.E4M3, scale=torch.tensor(1.0), amax_group=group)
    with pytest.raises(ValueError, match="unknown tensor role 'bias'"):
        FP8Linear(16, 16, amax_reduction_roles=("weight", "bias"))
