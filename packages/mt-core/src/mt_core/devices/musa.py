"""The ``musa`` device plugin: Moore Threads GPUs through ``torch_musa``.

``torch_musa`` adds ``torch.musa`` (a CUDA-like module) and the ``mccl``
collective backend. It is imported only when the device is used, so this
plugin registers on machines without it; there the device is simply not
available, and using it explicitly raises an error that says what to install.
FP8 GEMM support is not claimed: no FP8 path is validated on MUSA yet.
"""

from __future__ import annotations

from mt_core.device import AcceleratorDevice, Device
from mt_core.plugins import hookimpl
from mt_core.registry import Registry

MUSA_INSTALL_HINT = (
    "install Moore Threads' torch_musa (with the MUSA toolkit) matching your torch version"
)


def make_musa_device() -> AcceleratorDevice:
    return AcceleratorDevice(
        name="musa",
        type="musa",
        preferred_backend="mccl",
        module="torch.musa",
        requires="torch_musa",
        install_hint=MUSA_INSTALL_HINT,
    )


@hookimpl
def mt_register_devices(registry: Registry[Device]) -> None:
    registry.add("musa", make_musa_device, priority=200)
