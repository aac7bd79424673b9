"""Tests of the benchmark scripts on the CPU: the scripts are modules in ``benchmarks/``, not a
package, so that folder goes on ``sys.path``."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# Where the environment sets PYTHONDONTWRITEBYTECODE (CI's does) over an install holding no
# compiled modules (uv writes none), every interpreter the tests start (pytest-xdist's workers, the
# pools' fork server, torchrun ranks, subprocesses) would compile torch and the mt packages from
# source again, seconds each. Set before the imports below, they all write and read one bytecode
# cache instead, outside the source tree (in the virtual environment, else the temp folder), and
# child processes get it through the environment.
if sys.dont_write_bytecode:
    home = sys.prefix if sys.prefix != sys.base_prefix else tempfile.gettempdir()
    sys.pycache_prefix = sys.pycache_prefix or os.path.join(home, "pycache")
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

BENCHMARKS = Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
