"""Delayed scaling: amax history update, state-dict round trip, amax reduction over 2 gloo ranks."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mt_fp8 import DelayedScaling, FP8Format, FP8Linear, fp8_autocast, update_fp8_scales

E4M3_MAX, E5M2_MAX = FP8Format.E4M3.max, FP8Format.E5M2.max


def step(layer: FP8Linear, x: torch.Tensor, dy: torch.Tensor) -> None:
    layer(x).backward(dy)


def test_history_update_max_most_recent_and_margin():
    torch.manual_seed(0)
    for algo, margin in (("max", 0), ("most_recent", 2)):
        recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=algo, margin=margin)
        layer = FP8Linear(64, 32, recipe=recipe, bias=False)
        w_amax = layer.weight.detach().abs().max()
        amaxes = []
        for scale in (4.0, 1.0):
            x = torch.randn(16, 64) * scale
            dy = torch.randn(16, 32) * scale
            step(layer, x, dy)
            history_row = layer.fp8_meta.amax_history[0].clone()
            assert torch.equal(history_row, torch.stack([x.abs().max(), w_amax, dy.abs().max()]))
            update_fp8_scales(layer, recipe)
            amaxes.append(history_row)
            # Rolled: previous step moves to row 1, row 0 is cleared for the next step.
            assert torch.equal(layer.fp8_meta.amax_history[1], history_row)
            assert torch.equal(layer.fp8_meta.amax_history[0], torch.zeros(3))
        used = torch.maximum(*amaxes) if algo == "max" else amaxes[-1]
        fmt_max = torch.tensor([E4M3_MAX, E4M3_MAX, E5M2_MAX])
        assert torch.allclose(layer.fp8_meta.scale, used * 2.0**margin / fmt_max, rtol=1e-6)


def test_history_and_scales_round_trip_through_state_dict():
    recipe = DelayedScaling(amax_history_len=4)
    layer = FP8Linear(64, 32, recipe=recipe)
    for _ in range(2):
        step(layer, torch.randn(16, 64), torch.randn(16, 32))
        update_fp8_scales(layer, recipe)
    state = layer.state_dict()
    assert set(state) == {"weight", "bias", "fp8_meta.amax_history", "fp8_meta.scale"}
    assert all(isinstance(v, torch.Tensor) for v in state.values())  # safetensors-friendly
    restored = FP8Linear(64, 32, recipe=recipe)
    restored.load_state_dict(state)
    assert torch.equal(restored.fp8_meta.amax_history, layer.fp8_meta.amax_history)
    assert torch.equal(restored.fp8_meta.scale, layer.fp8_meta.scale)
    x = torch.randn(16, 64)
    assert torch.equal(restored(x), layer(x))


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
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
        torch.save(
            {"local": local, "scale": layer.fp8_meta.scale.clone()},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]


def test_amax_is_max_reduced_across_two_gloo_ranks(two_rank_results):
    rank0, rank1 = two_rank_results
    assert not torch.equal(rank0["local"], rank1["local"])
    global_amax = torch.maximum(rank0["local"], rank1["local"])
    fmt_max = torch.tensor([E4M3_MAX, E4M3_MAX, E5M2_MAX])
    assert torch.equal(rank0["scale"], rank1["scale"])
    assert torch.allclose(rank0["scale"], global_amax / fmt_max, rtol=1e-6)
