"""The plugin manager: built-ins, entry points, the env switches, the registrar, hook docs."""

from __future__ import annotations

import inspect

import pytest

import mt_core
from mt_core import hookspecs
from mt_core.registry import Registry

FAKE_PLUGIN = "fakeaccel"


@pytest.fixture(autouse=True)
def fresh_plugin_manager(monkeypatch: pytest.MonkeyPatch):
    """Each test starts from a clean environment and re-reads it."""
    for name in ("MT_DISABLE_PLUGIN_AUTOLOAD", "MT_DISABLED_PLUGINS", "MT_TRACE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    mt_core.reset_plugin_manager()
    yield
    mt_core.reset_plugin_manager()


def test_builtin_devices_are_plugins() -> None:
    names = mt_core.Plugins().plugin_names()
    assert {"cpu", "cuda", "musa"} <= set(names)
    assert {"cpu", "cuda", "musa"} <= set(mt_core.list_devices())


def test_third_party_plugin_is_discovered_through_entry_point(fake_plugin: None) -> None:
    assert FAKE_PLUGIN in mt_core.Plugins().plugin_names()
    assert "fakeaccel" in mt_core.list_devices()


def test_disable_autoload_skips_entry_points(
    fake_plugin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MT_DISABLE_PLUGIN_AUTOLOAD", "1")
    mt_core.reset_plugin_manager()
    assert FAKE_PLUGIN not in mt_core.Plugins().plugin_names()
    assert "fakeaccel" not in mt_core.list_devices()
    assert "cpu" in mt_core.list_devices()  # built-ins stay


def test_disabled_plugins_blocks_builtin_and_third_party(
    fake_plugin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MT_DISABLED_PLUGINS", "cuda, fakeaccel")
    mt_core.reset_plugin_manager()
    devices = mt_core.list_devices()
    assert "cuda" not in devices and "fakeaccel" not in devices
    assert "musa" in devices and "cpu" in devices
    with pytest.raises(KeyError, match="unknown device 'cuda'; known devices: musa, cpu"):
        mt_core.get_device("cuda")


def test_trace_plugins_prints_hook_calls(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MT_TRACE_PLUGINS", "1")
    mt_core.reset_plugin_manager()
    mt_core.list_devices()
    err = capsys.readouterr().err
    assert "[mt plugins]" in err and "mt_register_devices" in err


def test_select_device_hook_overrides_auto_detection(
    fake_plugin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MT_FAKEACCEL_AVAILABLE", "1")
    assert mt_core.get_device().name == "fakeaccel"  # priority 100 beats cpu's 0

    class PreferCPU:
        @mt_core.hookimpl
        def mt_select_device(self, available: list[str]) -> str | None:
            return "cpu" if "cpu" in available else None

    mt_core.get_plugin_manager().register(PreferCPU(), name="prefer-cpu")
    assert mt_core.get_device().name == "cpu"


def test_registry_rejects_duplicates_and_bad_names() -> None:
    registry: Registry[int] = Registry("widget")
    registry.add("a", lambda: 1)
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        registry.add("a", lambda: 2)
    with pytest.raises(ValueError, match="widget name 'bad name' is not valid"):
        registry.add("bad name", lambda: 3)
    with pytest.raises(KeyError, match="unknown widget 'b'; known widgets: a"):
        registry.get("b")


def test_duplicate_device_from_two_plugins_raises() -> None:
    class Clash:
        @mt_core.hookimpl
        def mt_register_devices(self, registry: Registry[mt_core.Device]) -> None:
            registry.add("cpu", object)

    mt_core.get_plugin_manager().register(Clash(), name="clash")
    with pytest.raises(ValueError, match="device 'cpu' is registered twice"):
        mt_core.Plugins().register_devices()


def test_every_hook_is_documented() -> None:
    """Each hookspec has a docstring and is listed, with its signature, in the module docstring."""
    specs = [
        (name, fn)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("mt_")
    ]
    assert specs, "no hookspecs found"
    for name, fn in specs:
        assert fn.__doc__ and len(fn.__doc__.strip()) > 40, f"{name} has no real docstring"
        parameters = ", ".join(inspect.signature(fn).parameters)
        assert f"{name}({parameters})" in hookspecs.__doc__, (
            f"{name}({parameters}) is missing from the hookspecs module docstring"
        )
    facade = {name for name, _ in inspect.getmembers(mt_core.Plugins, inspect.isfunction)}
    for name, _ in specs:
        assert name.removeprefix("mt_") in facade, f"Plugins has no method for {name}"
