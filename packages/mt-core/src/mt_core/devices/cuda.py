"""The ``cuda`` device plugin: NVIDIA GPUs through ``torch.cuda``, highest priority.

FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper, Blackwell); the
collective backend is NCCL.
"""

from __future__ import annotations

from mt_core.device import AcceleratorDevice, Device
from mt_core.plugins import hookimpl
from mt_core.registry import Registry

FP8_MIN_COMPUTE_CAPABILITY = (8, 9)


def _cuda_fp8_gemm(device: AcceleratorDevice) -> bool:
    capability = device.module.get_device_capability(device.current_device())
    return tuple(capability) >= FP8_MIN_COMPUTE_CAPABILITY


def make_cuda_device() -> AcceleratorDevice:
    return AcceleratorDevice(
        name="cuda",
        type="cuda",
        preferred_backend="nccl",
        module="torch.cuda",
        fp8_gemm=_cuda_fp8_gemm,
    )


@hookimpl
def mt_register_devices(registry: Registry[Device]) -> None:
    registry.add("cuda", make_cuda_device, priority=300)
