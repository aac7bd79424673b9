"""Shared test setup: GPU-marked tests skip cleanly on machines without CUDA; gloo process
pools are shared across test modules; the longest modules are handed to pytest-xdist's workers
first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mt_comm.testing import PoolCache, preload_in_ranks
from mt_core.testing import (
    long_modules_first,
    pytest_collection_modifyitems,  # noqa: F401
)

# Every rank of this package's pools imports these; the fork server does it once.
preload_in_ranks("mt_parallel")


@pytest.fixture(scope="session")
def distributed_pools() -> Iterator[PoolCache]:
    """Gloo process pools shared by the test modules this process runs, one per setting: a
    module's ``pool`` fixture returns ``distributed_pools.get(world_size=4)``."""
    with PoolCache() as pools:
        yield pools


LONG_MODULES = ("test_parallel_multigpu_rehearsal.py", "test_moe_data_parallel_world4.py")
"""The modules that run longest (a torchrun launch of 4 ranks; a dozen pool runs), longest
first. pytest-xdist hands modules out by their number of tests, which would leave these few-test
modules for last: one worker would run them alone while the other has finished."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``--dist loadfile`` (nox), xdist's scheduler handing out LONG_MODULES first."""
    return long_modules_first(config, log, LONG_MODULES)
