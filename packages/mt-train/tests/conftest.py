"""Shared test setup: GPU-marked tests skip cleanly without CUDA; the corpus is prepared once; gloo
process pools are shared across test modules; the longest few-test modules are handed to
pytest-xdist's workers first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mt_comm.testing import PoolCache, preload_in_ranks
from mt_core.testing import (
    long_modules_first,
    pytest_collection_modifyitems,  # noqa: F401
)
from mt_train.data import prepare_bundled

# Every rank of this package's pools imports these; the fork server does it once.
preload_in_ranks("mt_parallel", "mt_train")


@pytest.fixture(scope="session")
def kjv_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled corpus prepared as byte tokens (as the default run does), once per session."""
    folder = tmp_path_factory.mktemp("kjv")
    prepare_bundled(folder)
    return folder


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled digits image-text set (4 image tokens per image), once per session."""
    folder = tmp_path_factory.mktemp("digits")
    prepare_bundled(folder, val_every=5, name="digits", image_tokens=4)
    return folder


@pytest.fixture(scope="session")
def distributed_pools() -> Iterator[PoolCache]:
    """Gloo process pools shared by the test modules this process runs, one per setting: a
    module's ``pool`` fixture returns ``distributed_pools.get(world_size=4)``."""
    with PoolCache() as pools:
        yield pools


LONG_MODULES = (
    "test_train_multinode.py",
    "test_train_vlm_learning.py",
    "test_train_blend_dist.py",
    "test_train_moe_pipeline_world4.py",
)
"""Modules of one to three tests that run long (two torchrun agents; a learning run; pool runs),
longest first. pytest-xdist hands modules out by their number of tests, which would leave these
for last: one worker would run them alone while the other has finished."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``--dist loadfile`` (nox), xdist's scheduler handing out LONG_MODULES first."""
    return long_modules_first(config, log, LONG_MODULES)
