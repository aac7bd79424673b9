"""Test helpers shared by every mt package's test suite.

``pytest_collection_modifyitems`` skips tests marked ``gpu`` when no CUDA GPU is
visible, so GPU-only tests skip cleanly on CPU machines and CI. A package's
``tests/conftest.py`` enables it with::

    from mt_core.testing import pytest_collection_modifyitems  # noqa: F401

Importing this module does not import pytest; the hook only receives pytest objects.
"""

from __future__ import annotations

from typing import Any

import torch


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Mark every ``gpu`` test as skipped when ``torch.cuda.is_available()`` is False."""
    if torch.cuda.is_available():
        return
    import pytest

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
