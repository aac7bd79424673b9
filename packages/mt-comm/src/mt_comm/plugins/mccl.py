"""The ``mccl`` backend plugin: Moore Threads GPUs through ``torch_musa``.

Importing ``torch_musa`` registers the ``mccl`` process-group backend with
torch; without it there is no ``mccl`` and selecting it raises an error that
says what to install. The import happens in the factory, never at
registration, so this plugin loads on any machine.
"""

from __future__ import annotations

import importlib

from mt_comm.backend import CollectiveBackend
from mt_core import Registry, hookimpl


def make_mccl() -> CollectiveBackend:
    try:
        importlib.import_module("torch_musa")
    except ImportError as error:
        raise RuntimeError(
            "collective backend 'mccl' needs Moore Threads' torch_musa, which registers the "
            "'mccl' process-group backend with torch; it is not installed. Install torch_musa "
            "(with the MUSA toolkit and MCCL) matching your torch version, or choose another "
            "backend (nccl for CUDA, gloo for CPU)."
        ) from error
    return CollectiveBackend(name="mccl", torch_backend="mccl", device_types=("musa",))


@hookimpl
def mt_register_backends(registry: Registry[CollectiveBackend]) -> None:
    registry.add("mccl", make_mccl, device_types=("musa",))
