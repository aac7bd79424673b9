"""The plugin manager of mt and a typed facade over its hooks.

One pluggy project, ``"mt"``, one entry-point group, ``"mt"``. The manager is
created once per process by :func:`get_plugin_manager`:

1. register ``mt_core.hookspecs``;
2. block every name in ``MT_DISABLED_PLUGINS`` (comma-separated), so neither a
   built-in nor a third-party plugin of that name is ever registered;
3. register the built-in plugins (the ``cpu``, ``cuda`` and ``musa`` devices);
4. unless ``MT_DISABLE_PLUGIN_AUTOLOAD=1``, load the ``mt`` entry points of
   installed packages (third-party plugins);
5. with ``MT_TRACE_PLUGINS=1``, print every hook call and its result to stderr.

Packages above mt-core add their built-in plugins with
:func:`register_builtin_plugin`, which is idempotent and honours
``MT_DISABLED_PLUGINS`` too. Call sites use :class:`Plugins` (one method per
hook) instead of ``pm.hook.*``.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from mt_core import hookspecs
from mt_core.registry import Registry

if TYPE_CHECKING:
    from mt_core.device import Device

hookimpl = pluggy.HookimplMarker(hookspecs.PROJECT_NAME)
ENTRY_POINT_GROUP = "mt"

# Built-in plugins of mt-core: name -> module. They are registered through the
# same hooks as third-party plugins.
_CORE_BUILTINS = {
    "cpu": "mt_core.devices.cpu",
    "cuda": "mt_core.devices.cuda",
    "musa": "mt_core.devices.musa",
}

_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def disabled_plugin_names() -> set[str]:
    """Names listed in ``MT_DISABLED_PLUGINS`` (comma-separated, spaces ignored)."""
    raw = os.environ.get("MT_DISABLED_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use (see module docstring)."""
    global _manager
    with _lock:
        if _manager is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
            pm.add_hookspecs(hookspecs)
            for name in disabled_plugin_names():
                pm.set_blocked(name)
            for name, module in _CORE_BUILTINS.items():
                _register(pm, importlib.import_module(module), name)
            if not _env_flag("MT_DISABLE_PLUGIN_AUTOLOAD"):
                pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
            if _env_flag("MT_TRACE_PLUGINS"):
                pm.trace.root.setwriter(lambda message: sys.stderr.write(f"[mt plugins] {message}"))
                pm.enable_tracing()
            _manager = pm
        return _manager


def _register(pm: pluggy.PluginManager, plugin: ModuleType | object, name: str) -> None:
    if pm.is_blocked(name) or pm.has_plugin(name):
        return
    pm.register(plugin, name=name)


def register_builtin_plugin(name: str, module: str) -> None:
    """Register a built-in plugin module of an upper package (idempotent).

    A name listed in ``MT_DISABLED_PLUGINS`` stays unregistered.
    """
    pm = get_plugin_manager()
    with _lock:
        if not pm.is_blocked(name) and not pm.has_plugin(name):
            register_plugin(importlib.import_module(module), name)


def register_plugin(plugin: ModuleType | object, name: str) -> None:
    """Register a plugin module or object under ``name`` without an entry point (a notebook,
    a test); idempotent, and a name in ``MT_DISABLED_PLUGINS`` stays unregistered. Caches
    built from hooks are dropped, so the next lookup sees the plugin."""
    pm = get_plugin_manager()
    with _lock:
        _register(pm, plugin, name)
        _clear_caches()


def reset_plugin_manager() -> None:
    """Forget the manager so the next call re-reads the environment (tests use this)."""
    global _manager
    with _lock:
        _manager = None
        _clear_caches()


_cache_clearers: list[Any] = []


def on_plugins_changed(clear: Any) -> Any:
    """Register a zero-argument callable run whenever the set of plugins changes.

    Modules that cache registries built from hooks use it to drop their cache.
    """
    _cache_clearers.append(clear)
    return clear


def _clear_caches() -> None:
    for clear in _cache_clearers:
        clear()


class Plugins:
    """Typed facade: one method per hook, so call sites never touch ``pm.hook``."""

    def __init__(self, pm: pluggy.PluginManager | None = None) -> None:
        self.pm = pm or get_plugin_manager()

    def plugin_names(self) -> list[str]:
        """Names of all registered plugins."""
        return sorted(name for name, _ in self.pm.list_name_plugin())

    def register_devices(self) -> Registry[Device]:
        registry: Registry[Device] = Registry("device")
        self.pm.hook.mt_register_devices(registry=registry)
        return registry

    def select_device(self, available: list[str]) -> str | None:
        return self.pm.hook.mt_select_device(available=available)

    def register_backends(self) -> Registry[Any]:
        registry: Registry[Any] = Registry("collective backend")
        self.pm.hook.mt_register_backends(registry=registry)
        return registry

    def select_backend(self, device: Device) -> str | None:
        return self.pm.hook.mt_select_backend(device=device)

    def register_model_families(self) -> Registry[Any]:
        registry: Registry[Any] = Registry("model family")
        self.pm.hook.mt_register_model_families(registry=registry)
        return registry

    def register_loggers(self) -> Registry[Any]:
        registry: Registry[Any] = Registry("metric logger")
        self.pm.hook.mt_register_loggers(registry=registry)
        return registry
