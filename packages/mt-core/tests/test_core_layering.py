"""Dependencies run one way: no package imports a package above it.

The order, bottom to top, is mt_core < mt_comm, mt_fp8 < mt_parallel < mt_train < mt_plan,
and mt_fp8 must not import mt_comm (its amax process group is passed in).
The check reads every source file's imports (``import x`` and
``from x import y``, also inside functions) without importing anything, and
compares them with what each pyproject declares.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGES_DIR = Path(__file__).resolve().parents[2]
ALLOWED = {
    "mt_core": set(),
    "mt_comm": {"mt_core"},
    "mt_fp8": {"mt_core"},
    "mt_parallel": {"mt_core", "mt_comm", "mt_fp8"},
    "mt_train": {"mt_core", "mt_comm", "mt_fp8", "mt_parallel"},
    "mt_plan": {"mt_core", "mt_comm", "mt_fp8", "mt_parallel", "mt_train"},
}


def imported_mt_packages(source_dir: Path) -> dict[str, set[str]]:
    """{imported mt package: files importing it} for every .py file under ``source_dir``."""
    found: dict[str, set[str]] = {}
    for path in source_dir.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in ALLOWED:
                    found.setdefault(top, set()).add(str(path.relative_to(PACKAGES_DIR)))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_packages_below_it(package: str) -> None:
    source = PACKAGES_DIR / package.replace("_", "-") / "src" / package
    assert source.is_dir(), f"{source} is missing"
    imports = imported_mt_packages(source)
    forbidden = {
        name: sorted(files)
        for name, files in imports.items()
        if name != package and name not in ALLOWED[package]
    }
    assert not forbidden, f"{package} imports packages above it: {forbidden}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_declared_dependencies_match_layering(package: str) -> None:
    pyproject = (PACKAGES_DIR / package.replace("_", "-") / "pyproject.toml").read_text()
    declared = {name.replace("-", "_") for name in re.findall(r'"(mt-[a-z0-9]+)==', pyproject)}
    assert declared == ALLOWED[package], (
        f"{package} declares {sorted(declared)}, the layering allows exactly {sorted(ALLOWED[package])}"
    )
