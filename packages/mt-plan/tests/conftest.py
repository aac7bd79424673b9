"""Shared test setup: GPU-marked tests skip cleanly without CUDA; the corpus is prepared once."""

from __future__ import annotations

from pathlib import Path

import pytest

from mt_core.testing import pytest_collection_modifyitems  # noqa: F401
from mt_train.data import prepare_bundled


@pytest.fixture(scope="session")
def kjv_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled corpus prepared as byte tokens, once per session."""
    folder = tmp_path_factory.mktemp("kjv")
    prepare_bundled(folder)
    return folder
