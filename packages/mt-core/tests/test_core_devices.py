"""Devices: the CPU device, auto-detection, capabilities and clear errors."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import mt_core
from mt_core.device import AcceleratorDevice


@pytest.fixture(autouse=True)
def fresh_plugin_manager(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MT_DISABLED_PLUGINS", raising=False)
    monkeypatch.delenv("MT_FAKEACCEL_AVAILABLE", raising=False)
    mt_core.reset_plugin_manager()
    yield
    mt_core.reset_plugin_manager()


def test_cpu_device_basics() -> None:
    cpu = mt_core.get_device("cpu")
    assert cpu.is_available() and cpu.device_count() == 1
    assert cpu.torch_device() == torch.device("cpu")
    assert cpu.preferred_backend == "gloo"
    assert not cpu.has_streams
    with pytest.raises(NotImplementedError, match="has no streams"):
        cpu.stream()
    stats = cpu.memory_stats()
    assert stats["allocated"] > 0 and stats["peak_allocated"] > 0
    caps = cpu.capabilities()
    assert caps.bf16 and not caps.fp8_gemm and caps.peak_bf16_flops is None
    with pytest.raises(ValueError, match="cpu has one device"):
        cpu.set_device(1)


def test_cpu_rng_state_round_trip() -> None:
    cpu = mt_core.get_device("cpu")
    cpu.manual_seed(1234)
    state = cpu.get_rng_state()
    first = torch.rand(8)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(8), first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks cuda on a GPU machine")
def test_auto_detection_falls_back_to_cpu() -> None:
    assert mt_core.available_devices()[-1] == "cpu"
    assert mt_core.get_device().name == "cpu"


def test_unknown_device_lists_known_ones() -> None:
    with pytest.raises(
        KeyError, match=r"unknown device 'tpu'; known devices: .*cpu.*\(or 'auto'\)"
    ):
        mt_core.get_device("tpu")


def test_musa_without_torch_musa_says_what_to_install() -> None:
    if "torch_musa" in sys.modules:
        pytest.skip("torch_musa is installed here")
    with pytest.raises(RuntimeError, match="needs the Python package 'torch_musa'"):
        mt_core.get_device("musa")
    assert "musa" not in mt_core.available_devices()


@pytest.mark.parametrize(
    ("name", "bf16", "fp8"),
    [
        ("NVIDIA H200", 989.4e12, 1978.9e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12, 1978.9e12),
        ("NVIDIA H100 PCIe", 756.0e12, 1513.0e12),
        ("NVIDIA A100-SXM4-80GB", 312.0e12, None),
        ("Some Future GPU", None, None),
    ],
)
def test_peak_flops_table(name: str, bf16: float | None, fp8: float | None) -> None:
    assert mt_core.lookup_peak_flops(name) == (bf16, fp8)


def _fake_cuda_module(capability: tuple[int, int], name: str) -> types.ModuleType:
    module = types.ModuleType("fake_cuda_module")
    module.is_available = lambda: True  # type: ignore[attr-defined]
    module.device_count = lambda: 2  # type: ignore[attr-defined]
    module.current_device = lambda: 0  # type: ignore[attr-defined]
    module.get_device_name = lambda index: name  # type: ignore[attr-defined]
    module.get_device_capability = lambda index: capability  # type: ignore[attr-defined]
    module.is_bf16_supported = lambda: capability >= (8, 0)  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize(
    ("capability", "name", "fp8", "fp8_peak"),
    [
        ((9, 0), "NVIDIA H200", True, 1978.9e12),
        ((8, 9), "NVIDIA L40S", True, 733.0e12),
        ((8, 0), "NVIDIA A100-SXM4-80GB", False, None),
    ],
)
def test_cuda_fp8_capability_follows_compute_capability(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    name: str,
    fp8: bool,
    fp8_peak: float | None,
) -> None:
    from mt_core.devices.cuda import _cuda_fp8_gemm

    monkeypatch.setitem(sys.modules, "fake_cuda_module", _fake_cuda_module(capability, name))
    device = AcceleratorDevice(
        "fakecuda", "cuda", "nccl", module="fake_cuda_module", fp8_gemm=_cuda_fp8_gemm
    )
    caps = device.capabilities()
    assert caps.fp8_gemm is fp8
    assert caps.peak_fp8_flops == fp8_peak
    assert caps.bf16


def test_third_party_device_selected_by_name(
    fake_plugin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MT_FAKEACCEL_AVAILABLE", "1")
    device = mt_core.get_device("fakeaccel")
    assert device.preferred_backend == "fakeccl"
    assert device.device_name() == "Fake Accelerator 1000"


def test_unavailable_third_party_device_is_a_clear_error(fake_plugin: None) -> None:
    with pytest.raises(RuntimeError, match="'fakeaccel' is registered but not available"):
        mt_core.get_device("fakeaccel")


@pytest.mark.gpu
def test_cuda_device_on_a_real_gpu() -> None:
    cuda = mt_core.get_device()
    assert cuda.name == "cuda" and cuda.preferred_backend == "nccl"
    cuda.set_device(0)
    assert cuda.torch_device() == torch.device("cuda", 0)
    stream, start, end = (
        cuda.stream(),
        cuda.event(enable_timing=True),
        cuda.event(enable_timing=True),
    )
    with torch.cuda.stream(stream):
        start.record()
        x = torch.randn(1024, 1024, device="cuda")
        y = x @ x
        end.record()
    cuda.synchronize()
    assert start.elapsed_time(end) >= 0 and torch.isfinite(y).all()
    stats = cuda.memory_stats()
    assert stats["peak_allocated"] >= 2 * 1024 * 1024 * 4 and stats["total"] > 0
    cuda.manual_seed(7)
    state = cuda.get_rng_state()
    first = torch.rand(4, device="cuda")
    cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)
    caps = cuda.capabilities()
    major, minor = torch.cuda.get_device_capability()
    assert caps.fp8_gemm == ((major, minor) >= (8, 9))
    if "H200" in torch.cuda.get_device_name() or "H100" in torch.cuda.get_device_name():
        assert caps.peak_bf16_flops is not None and caps.peak_fp8_flops is not None
