"""Sessions for the mt monorepo: ``nox -l`` lists them; ``nox`` runs lint, every package's tests
(the default tier), the benchmark scripts' tests and mt-fp8's Triton kernels in Triton's
interpreter.

Each package is tested in its own virtual environment holding only that
package and what its pyproject declares (plus pytest), installed from the
source tree as a normal (non-editable) install, so a missing dependency or
missing package data fails here rather than for a user.

Two tiers: ``tests`` (and ``tests-<package>``) run ``pytest -m "not slow"``, the default tier
CI runs on two CPU cores; ``tests-full`` runs every test, ``slow`` ones included. A test is
marked ``slow`` only where a faster test of the default tier covers the same code.

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
nox.options.sessions = ["lint", "tests", "tests-mt-fp8-triton"]

TORCH_REQUIREMENT = os.environ.get("MT_TORCH_REQUIREMENT", "torch==2.13.0")
TRITON_REQUIREMENT = os.environ.get("MT_TRITON_REQUIREMENT", "triton==3.9.0")
FAKE_PLUGIN = "packages/mt-core/tests/fake_plugin"
DEFAULT_TIER = ("-m", "not slow")
"""pytest's marker filter for the default tier; ``-m ""`` after it (``tests-full``) clears it."""
TEST_WORKERS = os.environ.get("MT_TEST_WORKERS", "2")
"""pytest-xdist workers per session (``MT_TEST_WORKERS``; ``0`` runs in one process)."""
PARALLEL_ARGS = ("-n", TEST_WORKERS, "--dist", "loadfile")
"""Test modules run on ``TEST_WORKERS`` processes, each module whole on one worker (its
module-scoped fixtures are built once). Each worker shares its spawned gloo process pools across
the modules it runs (the ``distributed_pools`` fixture: one pool per world size), so a world size
starts at most once per worker. ``--dist loadgroup`` with a group per world size would save one
start of each (seconds) but pin all those modules to one worker however long they run, and it
hands unmarked tests out one by one; ``loadfile`` keeps the balance. Tests run with
``OMP_NUM_THREADS=1``, so one single-process test leaves the other core of a 2-core machine
idle; two workers use it."""

# package -> the mt packages it depends on (its own pyproject says the same;
# packages/mt-core/tests/test_core_layering.py checks both agree).
PACKAGES: dict[str, list[str]] = {
    "mt-core": [],
    "mt-comm": ["mt-core"],
    "mt-fp8": ["mt-core"],
    "mt-parallel": ["mt-core", "mt-comm", "mt-fp8"],
    "mt-train": ["mt-core", "mt-comm", "mt-fp8", "mt-parallel"],
    "mt-plan": ["mt-core", "mt-comm", "mt-fp8", "mt-parallel", "mt-train"],
}
# Packages whose tests use the third-party test plugin (a fake accelerator).
USES_FAKE_PLUGIN = {"mt-core", "mt-comm"}
# Packages whose tests need more than their pyproject declares: mt-plan's recorded kernel
# launch counts are checked against mt's runtime with mt-fp8's Triton kernels run in Triton's
# interpreter, each counted as the one launch it is on CUDA (test_plan_host.py).
TEST_REQUIREMENTS: dict[str, tuple[str, ...]] = {"mt-plan": (TRITON_REQUIREMENT,)}
# The mt-fp8 tests that call every Triton kernel against its PyTorch reference (bit for bit, or
# float64 with a stated bound): tensorwise quantize + transpose + amax, RMSNorm, RoPE, SwiGLU,
# cross-entropy (test_fp8_ops); the 1x128, MXFP8 1x32 and 128x128 block quantizers and the block
# GEMM (test_fp8_block_fast); the rowwise quantizer (test_fp8_rowwise_fast); AdamW
# (test_fp8_optim); MoE permute/unpermute (test_fp8_moe_permute); the grouped block-scaled
# GEMMs of FP8GroupedLinear's block recipe (test_fp8_grouped_block); its tensorwise weight stack
# (test_fp8_grouped_stack). The other mt-fp8 tests reach
# the same kernels through the layers and run under the interpreter too (pass them as
# arguments), in several times the time.
KERNEL_TESTS = tuple(
    f"packages/mt-fp8/tests/test_fp8_{name}.py"
    for name in (
        "ops",
        "block_fast",
        "rowwise_fast",
        "optim",
        "moe_permute",
        "grouped_block",
        "grouped_stack",
    )
)


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


def _install_package(session: nox.Session, package: str, *extra: str) -> None:
    """``package`` with its mt dependencies (and ``extra`` requirements) into the session."""
    local = [f"./packages/{dependency}" for dependency in PACKAGES[package]]
    extras = [FAKE_PLUGIN] if package in USES_FAKE_PLUGIN else []
    _install(session, TORCH_REQUIREMENT, "numpy", "pytest", "pytest-xdist", *extra)
    # --reinstall-package: the version never changes between edits, so force a rebuild.
    _install(
        session,
        *(f"--reinstall-package={name}" for name in [*PACKAGES[package], package]),
        *local,
        f"./packages/{package}[test]",
        *extras,
    )


def _test_env(session: nox.Session) -> dict[str, str]:
    """The environment of a test run: one thread per process, and one bytecode cache in the
    session's virtual environment that every interpreter of the run (pytest-xdist's workers,
    the pools' fork servers, torchrun ranks, subprocesses) writes and reads, so each compiles
    torch and the mt packages at most once, even where ``PYTHONDONTWRITEBYTECODE`` is set (CI's
    environment sets it, and uv installs no ``.pyc``); nothing is written beside the sources."""
    cache = os.path.join(session.virtualenv.location, "pycache")
    return {"OMP_NUM_THREADS": "1", "PYTHONPYCACHEPREFIX": cache, "PYTHONDONTWRITEBYTECODE": ""}


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    session.run(
        "pytest",
        *DEFAULT_TIER,
        *PARALLEL_ARGS,
        *args,
        *session.posargs,
        # The test fixtures are installed: a test that needs one must not skip.
        env={**_test_env(session), "MT_REQUIRE_TEST_FIXTURES": "1", **(env or {})},
    )


def _test_package(session: nox.Session, package: str) -> None:
    _install_package(session, package, *TEST_REQUIREMENTS.get(package, ()))
    _pytest(session, f"packages/{package}/tests")


def _make_package_session(package: str) -> None:
    @nox.session(name=f"tests-{package}")
    def tests_package(session: nox.Session) -> None:
        _test_package(session, package)

    tests_package.__doc__ = (
        f"Test {package} alone, with only its declared dependencies "
        f"({', '.join(PACKAGES[package]) or 'torch and pluggy'}); default tier. "
        "Extra args go to pytest (-m '' for the full tier)."
    )


for _package in PACKAGES:
    _make_package_session(_package)


@nox.session(name="tests-benchmarks")
def tests_benchmarks(session: nox.Session) -> None:
    """CPU tests of the benchmark scripts' own logic (verdicts, generated doc tables), with every
    package installed (the quality harness reads model shapes through mt-train)."""
    _install(session, TORCH_REQUIREMENT, "numpy", "pytest", "pytest-xdist")
    _install(
        session,
        *(f"--reinstall-package={name}" for name in PACKAGES),
        *(f"./packages/{name}" for name in PACKAGES),
    )
    session.run(
        "pytest", "benchmarks/tests", *PARALLEL_ARGS, *session.posargs, env=_test_env(session),
    )  # fmt: skip


@nox.session
def tests(session: nox.Session) -> None:
    """Run every package's default-tier tests, each in its own environment (tests-mt-core, ...),
    and the benchmark scripts' tests."""
    for package in PACKAGES:
        session.notify(f"tests-{package}", session.posargs)
    session.notify("tests-benchmarks", session.posargs)


@nox.session(name="tests-full")
def tests_full(session: nox.Session) -> None:
    """Run every package's tests, slow ones included, each in its own environment, and the
    benchmark scripts' tests."""
    for package in PACKAGES:
        session.notify(f"tests-{package}", ["-m", "", *session.posargs])
    session.notify("tests-benchmarks", session.posargs)


@nox.session(name="tests-mt-fp8-triton")
def tests_mt_fp8_triton(session: nox.Session) -> None:
    """mt-fp8's Triton kernels on the CPU, in Triton's interpreter (TRITON_INTERPRET=1).

    Installs the CPU wheel of Triton (``MT_TRITON_REQUIREMENT``, default the version checked
    here) and runs the tests that call each kernel (KERNEL_TESTS) against its PyTorch reference.
    Extra args go to pytest.
    """
    _install_package(session, "mt-fp8", TRITON_REQUIREMENT)
    _pytest(session, *KERNEL_TESTS, env={"TRITON_INTERPRET": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and format check of the whole tree (config in ruff.toml)."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
