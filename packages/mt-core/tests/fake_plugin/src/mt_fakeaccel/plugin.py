"""A third-party mt plugin: the ``fakeaccel`` device and its ``fakeccl`` backend.

This is the whole "add a new accelerator" story in one file, the way a vendor
would write it for real hardware:

- ``mt_register_devices`` adds a device (here it computes on the CPU, so the
  tests run anywhere; a real one would drive its own torch device type);
- ``mt_register_backends`` adds a collective backend whose factory registers
  a torch process-group constructor under the new name with
  ``torch.distributed.Backend.register_backend`` (here it wraps gloo and
  counts how many groups it built, so tests can prove it was used).

The device is available only when ``MT_FAKEACCEL_AVAILABLE=1``, so merely
installing this test package never changes what auto-detection picks.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from mt_core import Device, Registry, hookimpl
from mt_core.devices.cpu import CPUDevice

DEVICE_NAME = "fakeaccel"
BACKEND_NAME = "fakeccl"
# Process groups this process built through the fakeccl constructor.
process_groups_created = 0


class FakeAccelDevice(CPUDevice):
    """Computes on the CPU (inherited); reports itself as a distinct accelerator."""

    def __init__(self) -> None:
        super().__init__()
        self.name = DEVICE_NAME
        self.preferred_backend = BACKEND_NAME

    def is_available(self) -> bool:
        return os.environ.get("MT_FAKEACCEL_AVAILABLE") == "1"

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def device_name(self, index: int | None = None) -> str:
        return "Fake Accelerator 1000"


def _create_process_group(store, rank, size, timeout):  # type: ignore[no-untyped-def]
    """torch's constructor signature for a non-extended backend."""
    global process_groups_created
    process_groups_created += 1
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _make_backend():  # type: ignore[no-untyped-def]
    # Imported here, as a vendor plugin imports its CCL only when selected.
    from mt_comm import CollectiveBackend

    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu"])
    return CollectiveBackend(name=BACKEND_NAME, torch_backend=BACKEND_NAME, device_types=("cpu",))


@hookimpl
def mt_register_devices(registry: Registry[Device]) -> None:
    registry.add(DEVICE_NAME, FakeAccelDevice, priority=100)


@hookimpl
def mt_register_backends(registry: Registry[object]) -> None:
    registry.add(BACKEND_NAME, _make_backend, device_types=("cpu",))
