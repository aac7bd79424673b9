"""The ``gloo`` backend plugin: CPU tensors (torch's built-in ProcessGroupGloo).

gloo cannot carry FP8 dtypes; mt's collective helpers send them as ``uint8``.
"""

from __future__ import annotations

from mt_comm.backend import CollectiveBackend
from mt_core import Registry, hookimpl


def make_gloo() -> CollectiveBackend:
    return CollectiveBackend(name="gloo", torch_backend="gloo", device_types=("cpu",))


@hookimpl
def mt_register_backends(registry: Registry[CollectiveBackend]) -> None:
    registry.add("gloo", make_gloo, device_types=("cpu",))
