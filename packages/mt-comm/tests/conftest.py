"""Shared test setup: GPU-marked tests skip cleanly on machines without CUDA; gloo process
pools are shared across test modules."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator

# Where the environment sets PYTHONDONTWRITEBYTECODE (CI's does) over an install holding no
# compiled modules (uv writes none), every interpreter the tests start (pytest-xdist's workers, the
# pools' fork server, torchrun ranks, subprocesses) would compile torch and the mt packages from
# source again, seconds each. Set before the imports below, they all write and read one bytecode
# cache instead, outside the source tree (in the virtual environment, else the temp folder), and
# child processes get it through the environment.
if sys.dont_write_bytecode:
    home = sys.prefix if sys.prefix != sys.base_prefix else tempfile.gettempdir()
    sys.pycache_prefix = sys.pycache_prefix or os.path.join(home, "pycache")
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

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
