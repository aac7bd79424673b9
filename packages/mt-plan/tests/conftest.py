"""Shared test setup: GPU-marked tests skip cleanly without CUDA; the corpus is prepared once; gloo
process pools are shared across test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mt_comm.testing import PoolCache
from mt_core.testing import pytest_collection_modifyitems  # noqa: F401
from mt_train.data import prepare_bundled


@pytest.fixture(scope="session")
def kjv_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled corpus prepared as byte tokens, once per session."""
    folder = tmp_path_factory.mktemp("kjv")
    prepare_bundled(folder)
    return folder


@pytest.fixture(scope="session")
def distributed_pools() -> Iterator[PoolCache]:
    """Gloo process pools shared by the test modules this process runs, one per setting: a
    module's ``pool`` fixture returns ``distributed_pools.get(world_size=4)``."""
    with PoolCache() as pools:
        yield pools
