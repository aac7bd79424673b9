"""A pool of processes forming a gloo world, for multi-process tests.

Starting a process that imports torch costs seconds, so a :class:`DistributedPool`
runs many functions in the same ranks, and test suites share pools across test
modules: a :class:`PoolCache` starts one pool per setting (world size, device,
backend, environment, timeout) the first time a module asks for it and stops them
all when closed. Each package's ``tests/conftest.py`` holds one per session (under
pytest-xdist, one per worker process) as the ``distributed_pools`` fixture::

    # tests/conftest.py
    @pytest.fixture(scope="session")
    def distributed_pools():
        with PoolCache() as pools:
            yield pools

    # tests/test_sum_world4.py
    @pytest.fixture(scope="module")
    def pool(distributed_pools):
        return distributed_pools.get(world_size=4)

    def check_sum(scale):            # module level: it is pickled by reference
        t = torch.ones(1) * scale
        return mt_comm.all_reduce(t).item()

    def test_sum(pool):
        assert pool.run(check_sum, 2.0) == [8.0] * 4

A module whose setting no other module uses can start a pool of its own for its
lifetime instead (``with DistributedPool(world_size=8) as pool: yield pool``), so
its ranks do not stay alive until the session ends. A shared pool's ranks get
the test process's environment as it was when the pool started, so a module that
needs variables in its ranks passes them as ``env`` (part of the setting).

Ranks are forked from multiprocessing's fork server: one process per test process,
started with the first pool, that imports :data:`PRELOAD` (torch and mt_comm) and
then only forks. So a rank starts in a fraction of a second instead of paying the
imports itself. The server is a fresh interpreter that has run no torch operation:
no thread pool to lose in a fork, no process group, no CUDA context, so ranks can
initialise CUDA; anything added to :data:`PRELOAD` must keep it so. The server's
environment is the test process's at the first pool start, so every pool hands
its ranks the environment explicitly; only variables read while torch or mt_comm
is imported come from that first start. Ranks end with ``os._exit`` (as the fork
server's children do), without the interpreter's teardown.

Each worker sets the torchrun variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), ``OMP_NUM_THREADS=1``, and
calls :func:`mt_comm.init_distributed` with the pool's device and backend.
``run`` sends the function to every rank and returns the per-rank results in
rank order. After every function the worker destroys the parallel state and puts
back what it had when it became ready: the environment variables, the working
directory, torch's default dtype, deterministic-algorithms flags, thread count
and grad mode, and the CPU random generators of torch and Python. So neither
tests nor the modules sharing a pool leak those into each other; what a function
leaves in module-level caches of imported code stays (the ranks import each
module once). If any rank raises, ``run`` raises with every failing rank's
traceback; if some rank does not answer in time (stuck in a collective its failed
peers never joined), the pool is restarted, as it is before a function when a
rank has died since the last one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 180.0
CLOSE_GRACE_S = 2.0
"""How long :meth:`DistributedPool.close` waits for ranks to leave cleanly before killing them."""
PRELOAD = ("torch", "mt_comm.testing")
"""What the fork server imports before it forks any rank (every rank imports these anyway);
importing them must start no threads, process group or CUDA context (module docstring).
:func:`preload_in_ranks` adds to it."""
FAILURE_GRACE_S = 10.0


def preload_in_ranks(*modules: str) -> None:
    """Have the fork server import ``modules`` too, so ranks inherit them instead of importing
    them one by one. A conftest calls this at import, before any pool starts (the server imports
    its list once, when it starts). The modules must keep the server free of threads, process
    groups and CUDA contexts, and must read no environment variable at import that a pool's
    ``env`` is meant to set (ranks get that environment after the fork)."""
    global PRELOAD
    PRELOAD = (*PRELOAD, *(m for m in modules if m not in PRELOAD))


def whole_tensor(tensor: Any, group: Any) -> Any:
    """An FSDP2 parameter's or gradient's whole value (dim-0 shards over ``group``), else the
    tensor. Not ``full_tensor()``: after an in-place DTensor op (AdamW's), a tensor can carry
    the cached mesh of an earlier check's destroyed group (DTensor's sharding cache compares
    meshes by ranks), which a pool's processes may have run before this one."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    local, world = tensor.to_local(), dist.get_world_size(group)
    rows = -(-tensor.shape[0] // world)  # torch.chunk's shard size; the last may be shorter
    padded = local.new_zeros((rows, *local.shape[1:]))
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat(pieces)[: tensor.shape[0]]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _capture_state() -> dict[str, Any]:
    """The process state a function run in a worker may change and a later one would see."""
    import random

    import torch

    return {
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "dtype": torch.get_default_dtype(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }


def _restore_state(state: dict[str, Any]) -> None:
    """Put back what :func:`_capture_state` captured."""
    import random

    import torch

    now = _capture_state()
    for name in now["environ"].keys() - state["environ"].keys():
        del os.environ[name]
    for name, value in state["environ"].items():
        if now["environ"].get(name) != value:
            os.environ[name] = value
    if now["cwd"] != state["cwd"]:
        os.chdir(state["cwd"])
    if now["dtype"] != state["dtype"]:
        torch.set_default_dtype(state["dtype"])
    if now["deterministic"] != state["deterministic"]:
        deterministic, warn_only = state["deterministic"]
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    if now["threads"] != state["threads"]:
        torch.set_num_threads(state["threads"])
    torch.set_grad_enabled(state["grad"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    environ: dict[str, str],
    device: str,
    backend: str,
    collective_timeout_s: float,
    tasks: Any,
    results: Any,
) -> None:
    # The fork server's environment is the test process's at the first pool start: take the
    # one this pool started with instead.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    import datetime

    import torch

    torch.set_num_threads(1)
    from mt_comm.distributed import destroy_distributed, init_distributed
    from mt_comm.parallel_state import destroy_parallel_state

    try:
        init_distributed(
            backend=backend,
            device=device,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    ready_state = _capture_state()
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            outcome = (rank, True, value)
        except BaseException:
            outcome = (rank, False, traceback.format_exc())
        try:
            destroy_parallel_state()
            _restore_state(ready_state)
        except BaseException:
            outcome = (rank, False, traceback.format_exc())
        results.put(outcome)
    destroy_parallel_state()
    destroy_distributed()


class DistributedPool:
    """``world_size`` ranks with an initialised process group (see module docstring)."""

    def __init__(
        self,
        world_size: int,
        device: str = "cpu",
        backend: str = "auto",
        env: dict[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.env = dict(env or {})
        self.timeout_s = timeout_s
        self._processes: list[Any] = []
        self._start()

    def _start(self) -> None:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        port = free_port()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._results = context.Queue()
        self._processes = [
            context.Process(
                target=_worker,
                args=(
                    rank,
                    self.world_size,
                    port,
                    {**os.environ, **self.env},
                    self.device,
                    self.backend,
                    self.timeout_s / 2,
                    self._tasks[rank],
                    self._results,
                ),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()
        self._collect("start-up")

    def _collect(self, what: str) -> list[Any]:
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(values) + len(failures) < self.world_size:
            # Once a rank has failed, the others may wait forever in a collective:
            # give them only a short while to report.
            wait_s = FAILURE_GRACE_S if failures else self.timeout_s
            try:
                rank, ok, value = self._results.get(timeout=wait_s)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(values) - set(failures))
                self._restart()
                raise TimeoutError(
                    f"{what}: ranks {missing} gave no result within {wait_s:.0f} s"
                    + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
                ) from None
            if ok:
                values[rank] = value
            else:
                failures[rank] = value
        if failures:
            # Every rank reported, so none is stuck in a collective: the pool stays usable.
            raise AssertionError(
                f"{what} failed on ranks {sorted(failures)}:"
                + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            )
        return [values[rank] for rank in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; per-rank results in rank order."""
        if not all(process.is_alive() for process in self._processes):
            # A rank that died between functions (a function ended its process after it
            # answered) would leave every later function waiting for the timeout.
            self._restart()
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", repr(fn)))

    def _terminate(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(timeout=10)
        self._processes = []

    def _restart(self) -> None:
        self._terminate()
        self._start()

    def close(self) -> None:
        """Stop every worker: cleanly if it is idle, killed if not gone within CLOSE_GRACE_S."""
        for task_queue in self._tasks:
            task_queue.put(None)
        # One deadline for all ranks: a pool whose ranks are all stuck in a function costs
        # the grace once, not once per rank.
        deadline = time.monotonic() + CLOSE_GRACE_S
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._terminate()

    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PoolCache:
    """Pools shared by the test modules of one process, one per setting (module docstring).

    :meth:`get` starts a pool the first time a setting is asked for and returns the same pool
    afterwards; :meth:`close` (or leaving the ``with`` block) stops every pool.
    """

    def __init__(self) -> None:
        self._pools: dict[tuple[Any, ...], DistributedPool] = {}

    def get(
        self,
        world_size: int,
        device: str = "cpu",
        backend: str = "auto",
        env: dict[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> DistributedPool:
        """The pool of these settings (:class:`DistributedPool`'s arguments), started if new."""
        key = (world_size, device, backend, tuple(sorted((env or {}).items())), timeout_s)
        pool = self._pools.get(key)
        if pool is None:
            pool = DistributedPool(world_size, device, backend, env, timeout_s)
            self._pools[key] = pool
        return pool

    def close(self) -> None:
        """Stop every pool."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    def __enter__(self) -> PoolCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
