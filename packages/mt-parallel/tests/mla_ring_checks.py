"""Functions run on every rank of a DistributedPool by the ring-CP MLA tests: ``cp_parity`` of
:mod:`mla_checks` under ``cp_attention=ring`` with the ring's point-to-point messages counted."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mla_checks
import torch.distributed as dist


@contextlib.contextmanager
def ring_sends() -> Iterator[list[tuple[int, int]]]:
    """Record ``(tag, elements)`` of every tensor this rank sends through
    ``torch.distributed.batch_isend_irecv`` (the ring's only way out) while inside."""
    seen: list[tuple[int, int]] = []
    original = dist.batch_isend_irecv

    def counted(ops: list[Any]) -> Any:
        seen.extend((op.tag, op.tensor.numel()) for op in ops if op.op is dist.isend)
        return original(ops)

    dist.batch_isend_irecv = counted
    try:
        yield seen
    finally:
        dist.batch_isend_irecv = original


def ring_cp_parity(**kwargs: Any) -> dict:
    """:func:`mla_checks.cp_parity` with ``ring=True``, plus ``sends``: what this rank sent."""
    with ring_sends() as sends:
        result = mla_checks.cp_parity(ring=True, **kwargs)
    result["sends"] = sends
    return result
