"""Tests of the benchmark scripts on the CPU: the scripts are modules in ``benchmarks/``, not a
package, so that folder goes on ``sys.path``; the longest modules are handed to pytest-xdist's
workers first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mt_core.testing import long_modules_first

BENCHMARKS = Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


LONG_MODULES = ("test_pipeline_benchmarks.py", "test_moe_benchmarks.py")
"""The modules that run longest (torchrun launches of 4 and 2 ranks), longest first. pytest-xdist
hands modules out by their number of tests, which would leave these few-test modules for last:
one worker would run them alone while the other has finished."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``--dist loadfile`` (nox), xdist's scheduler handing out LONG_MODULES first."""
    return long_modules_first(config, log, LONG_MODULES)
