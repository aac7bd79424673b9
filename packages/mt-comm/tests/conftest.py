"""Shared test setup: GPU-marked tests skip cleanly on machines without CUDA; gloo process
pools are shared across test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mt_comm.testing import PoolCache, preload_in_ranks
from mt_core.testing import pytest_collection_modifyitems  # noqa: F401

# torch.use_deterministic_algorithms imports torch._inductor's config, seconds of imports: the
# fork server does it once instead of every rank of the process-state check (test_comm_world4).
preload_in_ranks("torch._inductor.config")


@pytest.fixture(scope="session")
def distributed_pools() -> Iterator[PoolCache]:
    """Gloo process pools shared by the test modules this process runs, one per setting: a
    module's ``pool`` fixture returns ``distributed_pools.get(world_size=4)``."""
    with PoolCache() as pools:
        yield pools
