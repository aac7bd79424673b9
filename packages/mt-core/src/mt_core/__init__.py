"""mt-core: the device abstraction and the pluggy plugin system of mt."""

from mt_core.device import PEAK_FLOPS, AcceleratorDevice, Capabilities, Device, lookup_peak_flops
from mt_core.hookspecs import PROJECT_NAME
from mt_core.plugins import (
    ENTRY_POINT_GROUP,
    Plugins,
    get_plugin_manager,
    hookimpl,
    register_builtin_plugin,
    register_plugin,
    reset_plugin_manager,
)
from mt_core.registry import Registry
from mt_core.selection import available_devices, get_device, list_devices

__version__ = "0.1.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "PEAK_FLOPS",
    "PROJECT_NAME",
    "AcceleratorDevice",
    "Capabilities",
    "Device",
    "Plugins",
    "Registry",
    "__version__",
    "available_devices",
    "get_device",
    "get_plugin_manager",
    "hookimpl",
    "list_devices",
    "lookup_peak_flops",
    "register_builtin_plugin",
    "register_plugin",
    "reset_plugin_manager",
]
