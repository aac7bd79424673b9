"""The hooks of mt, in the order they fire.

Every plugin of mt, built-in or third-party, implements some of these hooks
with ``@mt_core.hookimpl``. Third-party plugins are found through the
``mt`` entry-point group::

    [project.entry-points.mt]
    myaccel = "myaccel.mt_plugin"

Devices (mt-core)
    1. ``mt_register_devices(registry)``   -- every plugin adds its devices.
    2. ``mt_select_device(available)``     -- firstresult; overrides auto-detection.

Collective backends (used by mt-comm; specified here so there is one spec file)
    3. ``mt_register_backends(registry)``  -- every plugin adds its backends.
    4. ``mt_select_backend(device)``       -- firstresult; the backend for a device.

Model families (used by mt-train)
    5. ``mt_register_model_families(registry)`` -- every plugin adds its model families.

Metric loggers (used by mt-train)
    6. ``mt_register_loggers(registry)`` -- every plugin adds its metric loggers.

Registration hooks receive a :class:`mt_core.registry.Registry` and call
``registry.add(name, factory, ...)``; duplicate names raise. Registration must
be cheap and must not import vendor libraries (``torch_musa``, a vendor CCL)
or model code: those are imported when the device, backend or model family is
used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from mt_core.device import Device
    from mt_core.registry import Registry

PROJECT_NAME = "mt"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)

# --------------------------------------------------------------------------- devices


@hookspec
def mt_register_devices(registry: Registry[Device]) -> None:
    """Called once per plugin manager to collect devices.

    Add each device with ``registry.add(name, factory, priority=int)``, where
    ``factory()`` returns a :class:`mt_core.Device`. ``priority`` orders
    auto-detection among available devices (higher first; built-ins: cuda 300,
    musa 200, cpu 0; third-party devices default to 100, between musa and cpu).
    """


@hookspec(firstresult=True)
def mt_select_device(available: list[str]) -> str | None:
    """Called by ``get_device("auto")`` with the available device names, best first.

    Return a name from ``available`` to override auto-detection, or None to
    leave the choice to the next implementation. Stops at the first non-None
    result.
    """


# ---------------------------------------------------------------- collective backends


@hookspec
def mt_register_backends(registry: Registry[Any]) -> None:
    """Called once per plugin manager to collect collective backends (mt-comm).

    Add each backend with ``registry.add(name, factory, device_types=(...))``,
    where ``factory()`` returns an ``mt_comm.CollectiveBackend``. A backend
    whose torch process group is not built into torch registers it inside its
    factory with ``torch.distributed.Backend.register_backend``.
    """


@hookspec(firstresult=True)
def mt_select_backend(device: Device) -> str | None:
    """Called by ``init_distributed(backend="auto")`` with the selected device.

    Return the name of a registered backend for ``device``, or None to defer.
    Stops at the first non-None result; the built-in implementation runs last
    and answers ``device.preferred_backend``.
    """


# --------------------------------------------------------------------------- model families


@hookspec
def mt_register_model_families(registry: Registry[Any]) -> None:
    """Called once per plugin manager to collect model families (mt-train).

    Add each family with ``registry.add(name, factory)``, where ``factory()``
    returns an ``mt_train.ModelFamily`` (its config dataclass, model builder,
    parallelize plan, FLOP and parameter counts, named sizes and Hugging Face
    adapter). mt-train's built-in families (``llama``) register through this
    hook too. The factory runs when mt-train first needs the families, so the
    plugin module itself should import no model code.
    """


# --------------------------------------------------------------------------- metric loggers


@hookspec
def mt_register_loggers(registry: Registry[Any]) -> None:
    """Called once per plugin manager to collect metric loggers (mt-train).

    Add each logger with ``registry.add(name, factory)``, where ``factory(cfg, run)`` takes
    mt-train's ``LoggingConfig`` and ``mt_train.loggers.RunInfo`` (run folder, run id, config,
    git commit) and returns an object with ``log(step, kind, metrics)`` and ``close()``
    (``mt_train.loggers.MetricSink``); it runs on rank 0 only. mt-train's built-in loggers
    (``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``) register through this hook too; a run
    enables a built-in with its ``logging.<name>`` switch and any other logger by name in
    ``logging.loggers``. The plugin module should import no tracker library;
    the factory does.
    """
