"""Tests of the benchmark scripts on the CPU: the scripts are modules in ``benchmarks/``, not a
package, so that folder goes on ``sys.path``; the longest modules are handed to pytest-xdist's
workers first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


LONG_MODULES = ("test_pipeline_benchmarks.py", "test_moe_benchmarks.py")
"""The modules that run longest (torchrun launches of 4 and 2 ranks), longest first. pytest-xdist
hands modules out by their number of tests, which would leave these few-test modules for last:
one worker would run them alone while the other has finished."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``--dist loadfile`` (nox), xdist's scheduler handing out LONG_MODULES first."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    if not hasattr(LoadFileScheduling, "_assign_work_unit"):  # the private method overridden
        return None

    class LongModulesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node: object) -> None:
            for name in reversed(LONG_MODULES):
                for scope in [s for s in self.workqueue if s.rsplit("/", 1)[-1] == name]:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongModulesFirst(config, log)
