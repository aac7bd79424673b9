"""Backends and init_distributed in one process: selection, errors, the world of one."""

from __future__ import annotations

import datetime
import sys

import pytest
import torch
import torch.distributed as dist

import mt_comm
import mt_core


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MT_DISABLED_PLUGINS", raising=False)
    monkeypatch.delenv("MT_FAKEACCEL_AVAILABLE", raising=False)
    mt_core.reset_plugin_manager()
    yield
    mt_comm.destroy_parallel_state()
    mt_comm.destroy_distributed()
    mt_core.reset_plugin_manager()


def test_builtin_backends_are_registered() -> None:
    assert {"nccl", "gloo", "mccl"} <= set(mt_comm.list_backends())


def test_auto_selection_follows_the_device() -> None:
    assert mt_comm.select_backend(mt_core.get_device("cpu")).name == "gloo"
    assert mt_comm.get_backend("nccl").device_types == ("cuda",)


def test_unknown_backend_lists_known_ones() -> None:
    with pytest.raises(
        KeyError, match=r"unknown collective backend 'hccl'; known backends: .*gloo"
    ):
        mt_comm.get_backend("hccl")


def test_mccl_without_torch_musa_says_what_to_install() -> None:
    if "torch_musa" in sys.modules:
        pytest.skip("torch_musa is installed here")
    with pytest.raises(RuntimeError, match="'mccl' needs Moore Threads' torch_musa"):
        mt_comm.get_backend("mccl")


def test_backend_for_the_wrong_device_type_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"'nccl' serves device types \['cuda'\].*type 'cpu'"):
        mt_comm.init_distributed(backend="nccl", device="cpu")


def test_disabled_backend_plugin_disappears(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MT_DISABLED_PLUGINS", "nccl")
    mt_core.reset_plugin_manager()
    assert "nccl" not in mt_comm.list_backends()
    assert "gloo" in mt_comm.list_backends()


def test_world_of_one_without_torchrun() -> None:
    context = mt_comm.init_distributed(device="cpu")
    assert (context.rank, context.world_size, context.local_rank) == (0, 1, 0)
    assert context.backend is None and not dist.is_initialized()
    assert mt_comm.init_distributed() is context  # idempotent
    state = mt_comm.init_parallel_state()
    assert state.size("tp") == 1 and state.group("dp") is None
    assert state.is_first_stage and state.is_last_stage and state.pp_next_rank is None
    x = mt_comm.all_gather(mt_comm.all_reduce(mt_comm.reduce_scatter(torch.tensor([1.0, 2.0]))))
    assert x.tolist() == [1.0, 2.0]


def test_world_of_one_rejects_larger_dims() -> None:
    mt_comm.init_distributed(device="cpu")
    with pytest.raises(ValueError, match="= 2 must equal the world size 1"):
        mt_comm.init_parallel_state(dp=2)


def test_torchrun_world_of_one_builds_a_gloo_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from mt_comm.testing import free_port

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    context = mt_comm.init_distributed(timeout=datetime.timedelta(seconds=30))
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert context.backend is not None and context.backend.name == "gloo"


def test_timeout_must_be_a_timedelta() -> None:
    with pytest.raises(TypeError, match=r"timeout must be a datetime\.timedelta, got 30"):
        mt_comm.init_distributed(timeout=30)  # type: ignore[arg-type]
