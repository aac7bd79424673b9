"""Test helpers shared by every mt package's test suite.

``pytest_collection_modifyitems`` skips tests marked ``gpu`` when no CUDA GPU is
visible, so GPU-only tests skip cleanly on CPU machines and CI. A package's
``tests/conftest.py`` enables it with::

    from mt_core.testing import pytest_collection_modifyitems  # noqa: F401

``require_test_fixture`` is for tests that need something installed beside the package (the
third-party test plugin in ``packages/mt-core/tests/fake_plugin``): a plain ``pytest`` run skips
them with a reason that says how to install it; ``MT_REQUIRE_TEST_FIXTURES=1`` (nox sets it, since
it installs the fixtures) turns the skip into a failure, so CI never skips them silently.

Importing this module does not import pytest; the hook only receives pytest objects.
"""

from __future__ import annotations

import os
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


REQUIRE_FIXTURES_ENV = "MT_REQUIRE_TEST_FIXTURES"
"""Set to ``1`` to fail, rather than skip, tests whose fixture is not installed."""


def require_test_fixture(installed: bool, what: str, how: str) -> None:
    """Skip the calling test when ``installed`` is False, saying ``how`` to install ``what``;
    under ``MT_REQUIRE_TEST_FIXTURES=1`` fail it instead (module docstring)."""
    if installed:
        return
    import pytest

    message = f"{what} is not installed: {how}"
    if os.environ.get(REQUIRE_FIXTURES_ENV) == "1":
        pytest.fail(f"{message} ({REQUIRE_FIXTURES_ENV}=1)")
    pytest.skip(message)


def long_modules_first(config: Any, log: object, long_modules: tuple[str, ...]) -> object | None:
    """For a conftest's ``pytest_xdist_make_scheduler``: under ``--dist loadfile`` (nox),
    pytest-xdist's scheduler handing out ``long_modules`` (file names, longest first) before the
    rest. xdist hands modules out by their number of tests, which would leave long modules of a
    few tests for last, run alone on one worker while the others have finished. None (xdist's
    own order) under another mode, or if the private method this overrides is gone."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    if not hasattr(LoadFileScheduling, "_assign_work_unit"):
        return None

    class LongModulesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node: object) -> None:
            for name in reversed(long_modules):
                for scope in [s for s in self.workqueue if s.rsplit("/", 1)[-1] == name]:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongModulesFirst(config, log)
