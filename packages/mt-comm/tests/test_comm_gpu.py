"""NCCL on a real GPU: a torchrun-style world of one selects nccl and binds cuda:0."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import mt_comm
import mt_core
from mt_comm.testing import free_port


@pytest.mark.gpu
def test_nccl_world_of_one_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    mt_core.reset_plugin_manager()
    try:
        context = mt_comm.init_distributed(timeout=datetime.timedelta(seconds=60))
        assert context.device.name == "cuda" and context.backend.name == "nccl"
        assert dist.get_backend() == "nccl"
        assert torch.cuda.current_device() == 0
        state = mt_comm.init_parallel_state()
        x = torch.full((4,), 3.0, device="cuda")
        dist.all_reduce(x, group=state.group("world"))
        assert x.tolist() == [3.0] * 4
        fp8 = torch.randn(16, device="cuda").to(torch.float8_e4m3fn)
        shared = fp8.clone()
        mt_comm.broadcast(shared, src=0)
        assert torch.equal(shared.view(torch.uint8), fp8.view(torch.uint8))
    finally:
        mt_comm.destroy_parallel_state()
        mt_comm.destroy_distributed()
