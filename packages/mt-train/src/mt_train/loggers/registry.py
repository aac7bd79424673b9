"""The registered metric loggers and the ones a run enables.

:func:`logger_factories` asks every plugin's ``mt_register_loggers(registry)`` hook
(:mod:`mt_core.hookspecs`) once, after registering mt-train's built-ins
(:mod:`mt_train.loggers.plugin`), and caches the factories until the plugin set changes.
:func:`enabled_loggers` reads the names a run asks for off its ``logging`` config: the
built-ins through their switches (``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``), then
``logging.loggers`` in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from mt_core import Plugins, register_builtin_plugin
from mt_core.plugins import on_plugins_changed
from mt_train.config.schema import LoggingConfig
from mt_train.loggers.base import MetricSink, RunInfo

BUILTIN_LOGGER_PLUGIN = ("mt_train.loggers", "mt_train.loggers.plugin")
SWITCHES = ("jsonl", "tensorboard", "wandb", "mlflow")
"""Built-in loggers turned on by the ``logging`` field of the same name."""

Factory = Callable[[LoggingConfig, RunInfo], MetricSink]


@functools.cache
def logger_factories() -> dict[str, Factory]:
    """Every registered logger factory by name (module docstring)."""
    register_builtin_plugin(*BUILTIN_LOGGER_PLUGIN)
    return {entry.name: entry.factory for entry in Plugins().register_loggers()}


on_plugins_changed(logger_factories.cache_clear)


def enabled_loggers(cfg: LoggingConfig) -> list[str]:
    """The names of the loggers ``cfg`` turns on; an unknown name lists the registered ones."""
    names = [name for name in SWITCHES if getattr(cfg, name)] + list(cfg.loggers)
    known = logger_factories()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"logging.loggers names {unknown}, which no plugin registers; registered: "
            f"{', '.join(sorted(known))}"
        )
    return names


def build_sinks(
    cfg: LoggingConfig, run: RunInfo, on_os_error: Callable[[str, OSError], None]
) -> dict[str, Any]:
    """One sink per enabled logger, by name (call on rank 0 only). A logger that cannot start
    for an operating-system reason (a full or read-only disk) is reported to ``on_os_error``
    and left out; any other error (a missing package) is raised."""
    factories = logger_factories()
    sinks = {}
    for name in enabled_loggers(cfg):
        try:
            sinks[name] = factories[name](cfg, run)
        except OSError as err:
            on_os_error(name, err)
    return sinks
