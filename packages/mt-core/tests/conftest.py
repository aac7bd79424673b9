"""Shared test setup: GPU-marked tests skip cleanly on machines without CUDA, and tests of the
third-party test plugin (``fake_plugin/``) skip with how to install it when it is not installed."""

from __future__ import annotations

import importlib.metadata

import pytest

import mt_core
from mt_core.testing import (
    pytest_collection_modifyitems,  # noqa: F401
    require_test_fixture,
)

FAKE_PLUGIN = "fakeaccel"
"""The entry-point name of the test plugin in ``packages/mt-core/tests/fake_plugin``."""


@pytest.fixture
def fake_plugin() -> None:
    """The test plugin's entry point must be installed (``pip install``; nox does it)."""
    entry_points = importlib.metadata.entry_points(group=mt_core.ENTRY_POINT_GROUP)
    require_test_fixture(
        any(ep.name == FAKE_PLUGIN for ep in entry_points),
        "the test plugin mt-fakeaccel",
        "pip install packages/mt-core/tests/fake_plugin (nox installs it)",
    )
