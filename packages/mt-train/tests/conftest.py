"""Shared test setup: GPU-marked tests skip cleanly without CUDA; the corpus is prepared once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mt_train.data import prepare_bundled


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def kjv_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled corpus prepared as byte tokens (as the default run does), once per session."""
    folder = tmp_path_factory.mktemp("kjv")
    prepare_bundled(folder)
    return folder
