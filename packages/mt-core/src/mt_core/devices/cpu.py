"""The ``cpu`` device plugin: always available, lowest auto-detection priority.

The CPU has no streams, one "device", no peak-FLOP/s entry (MFU is not
reported) and gloo as its collective backend. FP8 GEMMs run through
``torch._scaled_mm``'s CPU kernel and mt-fp8's emulation, so ``fp8_gemm`` is
False: the CPU is for correctness, not FP8 speed.
"""

from __future__ import annotations

import platform

import torch

from mt_core.device import Capabilities, Device
from mt_core.plugins import hookimpl
from mt_core.registry import Registry


class CPUDevice(Device):
    """The host CPU as an mt device."""

    def __init__(self) -> None:
        super().__init__(name="cpu", type="cpu", preferred_backend="gloo")

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int | None = None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    def set_device(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"cpu has one device (index 0), got index {index}")

    def current_device(self) -> int:
        return 0

    def torch_device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        """Nothing to wait for: CPU ops complete before they return."""

    def memory_stats(self) -> dict[str, int]:
        """Resident set size of this process as ``allocated``; peak RSS as ``peak_allocated``."""
        try:
            import resource

            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        except ImportError:  # not on POSIX
            peak_kib = 0
        rss = _current_rss_bytes()
        return {"allocated": rss, "reserved": rss, "peak_allocated": peak_kib * 1024}

    def reset_peak_memory_stats(self) -> None:
        """The OS keeps the peak; it cannot be reset from inside the process."""

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def capabilities(self) -> Capabilities:
        return Capabilities(bf16=True, fp8_gemm=False, peak_bf16_flops=None, peak_fp8_flops=None)


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


@hookimpl
def mt_register_devices(registry: Registry[Device]) -> None:
    registry.add("cpu", CPUDevice, priority=0)
