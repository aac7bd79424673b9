"""Finding devices: :func:`get_device`, :func:`available_devices`, :func:`list_devices`.

Auto-detection takes the available device of highest ``priority`` (cuda 300 >
musa 200 > third-party 100 by default > cpu 0), unless a plugin's
``mt_select_device`` hook picks another. Devices are built once per plugin
set and cached; :func:`mt_core.reset_plugin_manager` clears the cache.
"""

from __future__ import annotations

import functools

from mt_core.device import Device
from mt_core.plugins import Plugins, on_plugins_changed
from mt_core.registry import Registry

THIRD_PARTY_DEFAULT_PRIORITY = 100


@functools.cache
def _device_registry() -> Registry[Device]:
    return Plugins().register_devices()


@functools.cache
def _device(name: str) -> Device:
    return _device_registry().get(name).factory()


def _clear() -> None:
    _device_registry.cache_clear()
    _device.cache_clear()


on_plugins_changed(_clear)


def list_devices() -> list[str]:
    """Names of all registered devices, available or not."""
    return _device_registry().names()


def available_devices() -> list[str]:
    """Names of the available devices, best first (by registered priority)."""
    registry = _device_registry()
    ranked = sorted(
        registry,
        key=lambda entry: -int(entry.metadata.get("priority", THIRD_PARTY_DEFAULT_PRIORITY)),
    )
    return [entry.name for entry in ranked if _device(entry.name).is_available()]


def get_device(name: str = "auto") -> Device:
    """The device called ``name``, or the best available one for ``"auto"``.

    An unknown name raises ``KeyError`` listing the known devices; a known but
    unavailable one raises ``RuntimeError`` saying which devices are available.
    """
    if name == "auto":
        available = available_devices()
        if not available:
            raise RuntimeError(
                f"no device is available; registered devices: {', '.join(list_devices())}"
            )
        chosen = Plugins().select_device(available) or available[0]
        if chosen not in available:
            raise RuntimeError(
                f"a plugin's mt_select_device chose {chosen!r}, which is not available "
                f"(available: {', '.join(available)})"
            )
        return _device(chosen)
    if name not in _device_registry():
        raise KeyError(
            f"unknown device {name!r}; known devices: {', '.join(list_devices())} (or 'auto')"
        )
    device = _device(name)
    if not device.is_available():
        raise RuntimeError(
            f"device {name!r} is registered but not available: {device.unavailable_reason()}; "
            f"available devices: {', '.join(available_devices())}"
        )
    return device
