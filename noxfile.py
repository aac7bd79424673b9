"""Sessions for the mt monorepo: ``nox -l`` lists them, ``nox`` runs lint and every package's tests.

Each package is tested in its own virtual environment holding only that
package and what its pyproject declares (plus pytest), installed from the
source tree as a normal (non-editable) install, so a missing dependency or
missing package data fails here rather than for a user.

torch: ``MT_TORCH_REQUIREMENT`` (default ``torch==2.13.0``) is installed first
in every session; set it to match your machine (for example a CUDA build).
uv ignores pip's configuration, so when pip is configured with a
``find-links`` directory (a local torch wheel), it is passed on to uv.
"""

from __future__ import annotations

import os
import subprocess
import sys

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

TORCH_REQUIREMENT = os.environ.get("MT_TORCH_REQUIREMENT", "torch==2.13.0")
FAKE_PLUGIN = "packages/mt-core/tests/fake_plugin"

# package -> the mt packages it depends on (its own pyproject says the same;
# packages/mt-core/tests/test_core_layering.py checks both agree).
PACKAGES: dict[str, list[str]] = {
    "mt-core": [],
    "mt-comm": ["mt-core"],
    "mt-fp8": ["mt-core"],
    "mt-parallel": ["mt-core", "mt-comm", "mt-fp8"],
    "mt-train": ["mt-core", "mt-comm", "mt-fp8", "mt-parallel"],
}
# Packages whose tests use the third-party test plugin (a fake accelerator).
USES_FAKE_PLUGIN = {"mt-core", "mt-comm"}


def _pip_find_links() -> str | None:
    """The find-links directory pip is configured with, if any (for uv)."""
    try:
        listing = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    except OSError:
        return None
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            return value.strip().strip("'\"")
    return None


def _install(session: nox.Session, *requirements: str) -> None:
    env = {}
    find_links = os.environ.get("UV_FIND_LINKS") or _pip_find_links()
    if find_links:
        env["UV_FIND_LINKS"] = find_links
    session.install(*requirements, env=env)


def _test_package(session: nox.Session, package: str) -> None:
    local = [f"./packages/{dependency}" for dependency in PACKAGES[package]]
    extras = [FAKE_PLUGIN] if package in USES_FAKE_PLUGIN else []
    _install(session, TORCH_REQUIREMENT, "numpy", "pytest")
    # --reinstall-package: the version never changes between edits, so force a rebuild.
    _install(
        session,
        *(f"--reinstall-package={name}" for name in [*PACKAGES[package], package]),
        *local,
        f"./packages/{package}[test]",
        *extras,
    )
    session.run(
        "pytest",
        f"packages/{package}/tests",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )


def _make_package_session(package: str) -> None:
    @nox.session(name=f"tests-{package}")
    def tests_package(session: nox.Session) -> None:
        _test_package(session, package)

    tests_package.__doc__ = (
        f"Test {package} alone, with only its declared dependencies "
        f"({', '.join(PACKAGES[package]) or 'torch and pluggy'}). Extra args go to pytest."
    )


for _package in PACKAGES:
    _make_package_session(_package)


@nox.session(name="tests-benchmarks")
def tests_benchmarks(session: nox.Session) -> None:
    """CPU tests of the benchmark scripts' own logic (verdicts, generated doc tables), with every
    package installed (the quality harness reads model shapes through mt-train)."""
    _install(session, TORCH_REQUIREMENT, "numpy", "pytest")
    _install(
        session,
        *(f"--reinstall-package={name}" for name in PACKAGES),
        *(f"./packages/{name}" for name in PACKAGES),
    )
    session.run("pytest", "benchmarks/tests", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def tests(session: nox.Session) -> None:
    """Run every package's tests, each in its own environment (tests-mt-core, ...), and the
    benchmark scripts' tests."""
    for package in PACKAGES:
        session.notify(f"tests-{package}", session.posargs)
    session.notify("tests-benchmarks", session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and format check of the whole tree (config in ruff.toml)."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
