"""Timing and result plumbing shared by the benchmark scripts.

Timers (all return milliseconds per call; torch is imported on first use, so a script that only
launches others can import this module without it):

* :func:`median_ms`: ``warmup`` untimed calls, then the median of ``repeats`` timed calls. On
  CUDA each call sits between two CUDA events and the device is synchronised before the events
  are read, so the time is the device's for that call, host launch cost included when the queue
  was idle; elsewhere it is wall-clock time around the call. ``before`` runs untimed before
  every call (clearing gradients, giving an input a new version).
* :func:`graph_ms`: ``calls`` calls captured in one CUDA graph and replayed once between two
  events: the kernels' device time per call, without host launch cost.
* :func:`kernel_ms`: the summed device time of the kernels of one call (PyTorch profiler, mean
  over ``calls``): what the call costs a step whose host runs ahead of the device.
* :func:`timed_steps`: consecutive steps between two device synchronisations (throughput), with
  a time budget.

:func:`copy_gbps` gives the device-to-device copy rate that the bandwidth-bound kernels are
compared with. :func:`run_isolated` runs one measurement in a subprocess (a crash, hang or
out-of-memory there is reported, and the next measurement starts from a fresh process), and
:func:`emit` / :func:`append_jsonl` write result rows as JSON lines.

The scripts in ``benchmarks/`` import it as ``import harness`` (their folder is on
``sys.path`` when run as ``python benchmarks/<script>.py``); ``benchmarks/multi_gpu/`` scripts
put ``benchmarks/`` on the path first.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _cuda_events() -> tuple[Any, Any]:
    import torch

    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def require_cuda() -> None:
    """Exit with a one-line message when no CUDA GPU is visible (the GPU-only scripts)."""
    import sys

    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{Path(sys.argv[0]).name} needs a CUDA GPU (none visible)")


def synchronize(device: Any) -> None:
    """Wait for the device's queued work (CUDA only; a no-op elsewhere)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(
    fn: Callable[[], object],
    *,
    repeats: int = 10,
    warmup: int = 3,
    before: Callable[[], object] | None = None,
    device: Any = "cuda",
) -> float:
    """Median milliseconds of one ``fn()`` over ``repeats`` calls (module docstring)."""
    import torch

    on_cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if on_cuda:
            start, end = _cuda_events()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def capture_graph(fn: Callable[[], object], calls: int = 1) -> Any:
    """A CUDA graph of ``calls`` calls of ``fn`` (warm ``fn`` up first: Triton compiles on its
    first call, which a capture cannot hold)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_ms(fn: Callable[[], object], *, calls: int = 50, warmup: int = 3) -> float:
    """Device milliseconds per call of ``fn``, from one replay of a graph of ``calls`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = capture_graph(fn, calls)
    graph.replay()
    torch.cuda.synchronize()
    start, end = _cuda_events()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def kernel_ms(fn: Callable[[], object], *, calls: int = 10, warmup: int = 3) -> float:
    """Mean summed device time of the kernels of one ``fn()`` call (PyTorch profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = sum(event.self_device_time_total for event in prof.key_averages())
    return total_us / calls / 1e3


def timed_steps(
    step: Callable[[], object],
    *,
    warmup: int,
    steps: int,
    sync: Callable[[], object],
    budget_s: float = math.inf,
) -> tuple[int, float]:
    """``(steps done, seconds)`` for up to ``steps`` consecutive steps after ``warmup`` ones,
    between two calls of ``sync`` (the device's synchronisation, e.g. ``lambda:
    synchronize(device)`` or an ``mt_core`` device's ``synchronize``); stops early once the
    timed steps pass ``budget_s``."""
    for _ in range(warmup):
        step()
    sync()
    began = time.perf_counter()
    done = 0
    while done < steps:
        step()
        done += 1
        if time.perf_counter() - began > budget_s:
            break
    sync()
    return done, time.perf_counter() - began


def copy_gbps(numel: int, dtype: Any = None, *, repeats: int = 10) -> float:
    """GB/s of a CUDA device-to-device copy of ``numel`` elements, counting read and write."""
    import torch

    src = torch.empty(numel, dtype=dtype or torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeats=repeats)
    return 2 * src.numel() * src.element_size() / ms / 1e6


@dataclass
class IsolatedRun:
    """What :func:`run_isolated` saw."""

    result: dict[str, Any] | None
    """The last result line's JSON object, or None."""
    error: str | None
    """Why there is no result (``timeout: ...`` or ``exit N: <last stderr line>``), or None."""
    returncode: int | None
    """The exit status, or None after a timeout."""
    stdout: str
    stderr: str


def run_isolated(
    command: Sequence[str],
    *,
    timeout_s: float,
    marker: str,
    env: dict[str, str] | None = None,
) -> IsolatedRun:
    """Run ``command``; its result is the JSON object on its last stdout line that starts with
    ``marker`` (the object starts at that line's first ``{``)."""
    try:
        proc = subprocess.run(
            list(command), capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except subprocess.TimeoutExpired as expired:
        return IsolatedRun(
            None,
            f"timeout: no result within {timeout_s:.0f} s",
            None,
            _text(expired.stdout),
            _text(expired.stderr),
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    if lines:
        result = json.loads(lines[-1][lines[-1].index("{") :])
        return IsolatedRun(result, None, proc.returncode, proc.stdout, proc.stderr)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    error = f"exit {proc.returncode}: {tail[:200]}"
    return IsolatedRun(None, error, proc.returncode, proc.stdout, proc.stderr)


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def append_jsonl(path: str | None, row: dict[str, Any]) -> None:
    """Append ``row`` as one JSON line to ``path`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def emit(row: dict[str, Any], out: str | None = None, prefix: str = "") -> None:
    """Print ``row`` as a JSON line (after ``prefix``) and append it to ``out``."""
    print(prefix + json.dumps(row), flush=True)
    append_jsonl(out, row)
