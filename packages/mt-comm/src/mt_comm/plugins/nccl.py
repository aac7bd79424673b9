"""The ``nccl`` backend plugin: NVIDIA GPUs (torch's built-in ProcessGroupNCCL).

NCCL carries FP8 dtypes natively since NCCL 2.19; mt still sends FP8 as bytes.
"""

from __future__ import annotations

from mt_comm.backend import CollectiveBackend
from mt_core import Registry, hookimpl


def make_nccl() -> CollectiveBackend:
    return CollectiveBackend(
        name="nccl", torch_backend="nccl", device_types=("cuda",), supports_fp8=True
    )


@hookimpl
def mt_register_backends(registry: Registry[CollectiveBackend]) -> None:
    registry.add("nccl", make_nccl, device_types=("cuda",))
