"""Tests of the benchmark scripts on the CPU: the scripts are modules in ``benchmarks/``, not a
package, so that folder goes on ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
