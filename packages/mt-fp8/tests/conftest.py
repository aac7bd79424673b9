"""Shared test setup: GPU-marked tests skip cleanly on machines without CUDA."""

from mt_core.testing import pytest_collection_modifyitems  # noqa: F401
