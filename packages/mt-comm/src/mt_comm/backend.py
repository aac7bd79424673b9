"""Collective backends: what ``init_distributed`` needs to create a process group.

A :class:`CollectiveBackend` names the torch process-group backend to pass to
``torch.distributed.init_process_group`` and the device types it serves.
Backends are plugins: every plugin's ``mt_register_backends(registry)`` adds
``registry.add(name, factory, device_types=(...))``. ``factory()`` is called
only when the backend is selected, so it is where a backend imports its vendor
library (``torch_musa`` for ``mccl``) and, if torch does not know its process
group yet, registers one with ``torch.distributed.Backend.register_backend``.

Selection (``backend="auto"``) goes through the firstresult hook
``mt_select_backend(device)``; the built-in implementation answers
``device.preferred_backend`` (cuda→nccl, musa→mccl, cpu→gloo).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mt_core import Device, Plugins, Registry, register_builtin_plugin
from mt_core.plugins import on_plugins_changed

# Built-in backend plugins of mt-comm: plugin name -> module.
BUILTIN_BACKEND_PLUGINS = {
    "nccl": "mt_comm.plugins.nccl",
    "gloo": "mt_comm.plugins.gloo",
    "mccl": "mt_comm.plugins.mccl",
    "mt_comm.select": "mt_comm.plugins.select",
}


@dataclass(frozen=True)
class CollectiveBackend:
    """A collective backend as mt sees it.

    ``torch_backend`` is the string given to ``init_process_group`` (often the
    same as ``name``); ``device_types`` the torch device types it serves;
    ``supports_fp8`` whether it can carry FP8 dtypes natively (mt's helpers
    send FP8 as ``uint8`` bytes regardless, so this is informational).
    """

    name: str
    torch_backend: str
    device_types: tuple[str, ...]
    supports_fp8: bool = False


def ensure_builtin_backends() -> None:
    """Register mt-comm's built-in backend plugins (idempotent)."""
    for name, module in BUILTIN_BACKEND_PLUGINS.items():
        register_builtin_plugin(name, module)


@functools.cache
def _backend_registry() -> Registry[CollectiveBackend]:
    ensure_builtin_backends()
    return Plugins().register_backends()


on_plugins_changed(_backend_registry.cache_clear)


def list_backends() -> list[str]:
    """Names of all registered collective backends."""
    return _backend_registry().names()


def get_backend(name: str) -> CollectiveBackend:
    """Build the backend called ``name``; an unknown name lists the known ones.

    Building runs the backend's vendor checks: ``mccl`` without ``torch_musa``
    raises a ``RuntimeError`` that says what to install.
    """
    registry = _backend_registry()
    if name not in registry:
        raise KeyError(
            f"unknown collective backend {name!r}; known backends: {', '.join(list_backends())} "
            "(or 'auto')"
        )
    return registry.get(name).factory()


def select_backend(device: Device) -> CollectiveBackend:
    """The backend for ``device`` chosen by the ``mt_select_backend`` hook."""
    ensure_builtin_backends()
    name = Plugins().select_backend(device)
    if name is None:
        raise RuntimeError(
            f"no plugin selected a collective backend for device {device.name!r}; "
            f"known backends: {', '.join(list_backends())}"
        )
    backend = get_backend(name)
    if device.type not in backend.device_types:
        raise RuntimeError(
            f"collective backend {name!r} serves device types {list(backend.device_types)}, "
            f"not {device.type!r} (device {device.name!r})"
        )
    return backend
