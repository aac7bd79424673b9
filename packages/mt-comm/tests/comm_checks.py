"""Functions run on every rank of a DistributedPool by the multi-process tests.

They live in a plain module (not a test module) so spawned workers import
them by name. Each returns plain data for the parent process to assert on.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading

import torch
import torch.distributed as dist

import mt_comm

DIMS = ("tp", "cp", "dp", "pp", "ep", "edp", "dp_cp", "tp_cp", "mp", "world")


def layout(**degrees: int) -> dict[str, object]:
    """Build the parallel state and report membership, coordinates and collective sums."""
    state = mt_comm.init_parallel_state(**degrees)
    rank = dist.get_rank()
    report: dict[str, object] = {"rank": rank}
    for dim in DIMS:
        group = state.group(dim)
        # Summing each member's global rank checks the group really is those ranks.
        total = mt_comm.all_reduce(torch.tensor([float(rank)]), group=group).item()
        gathered = mt_comm.all_gather(torch.tensor([rank]), group=group).tolist()
        report[dim] = {
            "ranks": state.ranks(dim),
            "rank": state.rank(dim),
            "size": state.size(dim),
            "group_rank": mt_comm.group_rank(group),
            "sum": total,
            "gathered": gathered,
        }
    report["pp_prev"] = state.pp_prev_rank
    report["pp_next"] = state.pp_next_rank
    return report


def collectives_on_tp_group() -> dict[str, list[float]]:
    """reduce_scatter / all_gather along dim 1, max/avg reductions (also started without
    waiting), all_to_all, broadcast."""
    state = mt_comm.init_parallel_state(dp=2, tp=2)
    tp = state.group("tp")
    rank = dist.get_rank()
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4) + 10 * rank
    scattered = mt_comm.reduce_scatter(x.clone(), dim=1, group=tp)
    gathered = mt_comm.all_gather(scattered, dim=1, group=tp)
    maximum = mt_comm.all_reduce(torch.tensor([float(rank)]), op="max", group=tp)
    average = mt_comm.all_reduce(torch.tensor([float(rank)]), op="avg", group=tp)
    started_sum = mt_comm.all_reduce_start(torch.tensor([float(rank)]), group=tp)
    started_avg = mt_comm.all_reduce_start(torch.tensor([float(rank)]), op="avg", group=tp)
    started_avg.wait()  # a second wait returns the same values (gloo's division happens once)
    to_send = torch.tensor([rank * 10.0 + i for i in range(2)])
    exchanged = mt_comm.all_to_all(to_send, group=tp)
    root = state.ranks("tp")[0]
    shared = mt_comm.broadcast(torch.tensor([float(rank)]), src=root, group=tp)
    return {
        "scattered": scattered.flatten().tolist(),
        "gathered": gathered.flatten().tolist(),
        "max": maximum.tolist(),
        "avg": average.tolist(),
        "started_sum": started_sum.wait().tolist(),
        "started_avg": started_avg.wait().tolist(),
        "all_to_all": exchanged.tolist(),
        "broadcast": shared.tolist(),
    }


def uneven_all_to_all() -> list[float]:
    """Rank r sends r+1 rows to each peer: the MoE token-dispatch pattern."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.full((world * (rank + 1),), float(rank))
    out = mt_comm.all_to_all(
        rows,
        output_split_sizes=[peer + 1 for peer in range(world)],
        input_split_sizes=[rank + 1] * world,
    )
    return out.tolist()


def fp8_round_trip(seed: int) -> dict[str, object]:
    """All-gather, broadcast and p2p of FP8 tensors; bytes must survive exactly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(seed + rank)
    results: dict[str, object] = {}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        local = (torch.randn(4, 8, generator=generator) * 50).to(dtype)
        gathered = mt_comm.all_gather(local, dim=1)
        assert gathered.dtype == dtype and gathered.shape == (4, 8 * world)
        results[f"{dtype}-gathered"] = gathered.view(torch.uint8)
        results[f"{dtype}-local"] = local.view(torch.uint8)
        shared = local.clone()
        mt_comm.broadcast(shared, src=0)
        results[f"{dtype}-broadcast"] = shared.view(torch.uint8)
    try:
        mt_comm.all_reduce(torch.zeros(2).to(torch.float8_e4m3fn))
    except TypeError as error:
        results["reduce_error"] = str(error)
    # Ring exchange: send to the next rank, receive from the previous one.
    payload = (torch.arange(16, dtype=torch.float32) + rank).to(torch.float8_e4m3fn)
    received = torch.empty_like(payload)
    mt_comm.batch_send_recv([(payload, (rank + 1) % world)], [(received, (rank - 1) % world)])
    results["ring_received"] = received.view(torch.uint8)
    return results


def pipeline_send_recv() -> list[float]:
    """Stage 0 sends activations forward; the next stage receives them (pp=2 groups)."""
    state = mt_comm.init_parallel_state(pp=2, tp=dist.get_world_size() // 2)
    activation = torch.tensor([float(dist.get_rank())] * 3)
    if state.pp_next_rank is not None:
        mt_comm.send(activation, dst=state.pp_next_rank)
        return activation.tolist()
    buffer = torch.empty(3)
    mt_comm.recv(buffer, src=state.pp_prev_rank)
    return buffer.tolist()


def fake_plugin_training(steps: int) -> dict[str, object]:
    """Train a linear model with gradients averaged through the fakeccl backend."""
    import mt_fakeaccel.plugin as fake

    context = mt_comm.get_distributed_context()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + context.rank)
    true_w = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w.T)
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            mt_comm.all_reduce(p.grad, op="avg")
        optimizer.step()
        losses.append(mt_comm.all_reduce(loss.detach().clone(), op="avg").item())
    return {
        "device": context.device.name,
        "backend": context.backend.name if context.backend else None,
        "torch_backend": dist.get_backend(),
        "groups_created": fake.process_groups_created,
        "losses": losses,
        "weight": model.weight.detach().clone(),
    }


def fail_on_rank_zero_then_all_reduce() -> float:
    """Rank 0 raises before a collective the others enter: they hang until the pool restarts."""
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails on purpose")
    return mt_comm.all_reduce(torch.ones(1)).item()


def process_state() -> dict[str, object]:
    """What a function sees of the process state the worker puts back after every function."""
    return {
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "torch_draw": torch.rand(2),
        "python_draw": random.random(),
    }


def change_process_state() -> None:
    """Change everything :func:`process_state` reports, and leave it changed."""
    os.environ["MT_TEST_LEFT_BEHIND"] = "1"
    del os.environ["OMP_NUM_THREADS"]
    os.chdir(tempfile.gettempdir())
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    torch.manual_seed(1234)
    random.seed(1234)


def exit_after_answering() -> int:
    """End this rank's process a moment after it has answered; returns its pid."""
    threading.Timer(0.1, os._exit, (0,)).start()
    return os.getpid()


def device_mesh_groups() -> dict[str, list[int]]:
    """The DeviceMesh's per-dimension groups must match ParallelState's."""
    state = mt_comm.init_parallel_state(dp=2, tp=2)
    mesh = state.device_mesh()
    return {
        dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in ("pp", "dp", "cp", "tp")
    } | {f"state_{dim}": state.ranks(dim) for dim in ("pp", "dp", "cp", "tp")}
