"""Distributed initialisation from the ``torchrun`` environment.

:func:`init_distributed` reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` (as set by ``torchrun``), picks the device
(``mt_core.get_device``) and its collective backend (the firstresult hook
``mt_select_backend``), binds this process to device ``LOCAL_RANK``, and
creates the default process group. It is idempotent: a second call returns
the same :class:`DistributedContext`. Without ``torchrun`` (no ``WORLD_SIZE``
in the environment, or ``WORLD_SIZE=1`` with no process group wanted) it sets
up a world of size 1 with no process group, and every collective helper in
:mod:`mt_comm.collectives` is then the identity.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mt_comm.backend import CollectiveBackend, get_backend, select_backend
from mt_core import Device, get_device

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: its ranks, the world, the device and backend.

    ``backend`` is None in a world of size 1 without a process group.
    """

    rank: int
    local_rank: int
    world_size: int
    device: Device
    backend: CollectiveBackend | None

    @property
    def torch_device(self) -> torch.device:
        """The ``torch.device`` this process is bound to."""
        return self.device.torch_device()

    @property
    def has_process_group(self) -> bool:
        return self.backend is not None


_context: DistributedContext | None = None


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def launched_by_torchrun() -> bool:
    """True when the torchrun variables ``RANK`` and ``WORLD_SIZE`` are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(
    backend: str = "auto",
    device: str = "auto",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> DistributedContext:
    """Initialise (once) the default process group from the torchrun environment.

    ``backend`` is a registered backend name or ``"auto"`` (the device's
    backend chosen through ``mt_select_backend``); ``device`` a registered
    device name or ``"auto"``. Returns the :class:`DistributedContext`; a second
    call returns the first context unchanged.
    """
    global _context
    if _context is not None:
        return _context
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")

    chosen_device = get_device(device)
    world_size = _int_env("WORLD_SIZE", 1)
    rank = _int_env("RANK", 0)
    local_rank = _int_env("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid torchrun environment: RANK={rank}, WORLD_SIZE={world_size}")
    if chosen_device.type != "cpu":
        count = chosen_device.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {count} {chosen_device.name} device(s) are "
                "visible; launch at most that many processes per node"
            )
        chosen_device.set_device(local_rank)

    if dist.is_initialized():
        chosen_backend = _backend_from_name(backend, chosen_device)
    elif launched_by_torchrun():
        chosen_backend = _backend_from_name(backend, chosen_device)
        dist.init_process_group(
            backend=chosen_backend.torch_backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=chosen_device.torch_device(local_rank)
            if chosen_device.type == "cuda"
            else None,
        )
    else:
        chosen_backend = None

    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    _context = DistributedContext(rank, local_rank, world_size, chosen_device, chosen_backend)
    return _context


def _backend_from_name(name: str, device: Device) -> CollectiveBackend:
    if name == "auto":
        return select_backend(device)
    backend = get_backend(name)
    if device.type not in backend.device_types:
        raise ValueError(
            f"collective backend {name!r} serves device types {list(backend.device_types)}, "
            f"but the selected device {device.name!r} has type {device.type!r}"
        )
    return backend


def get_distributed_context() -> DistributedContext:
    """The context created by :func:`init_distributed`; raises if it was not called."""
    if _context is None:
        raise RuntimeError("init_distributed() has not been called in this process")
    return _context


def destroy_distributed() -> None:
    """Destroy the default process group (if mt created one) and forget the context."""
    global _context
    if dist.is_initialized():
        dist.destroy_process_group()
    _context = None
