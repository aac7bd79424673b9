"""Calibration tables: measured op speeds on one device, and the roofline for the rest.

A table (JSON) has ``device`` and ``entries``; each entry is one measurement::

    {"op": "gemm_fwd", "dtype": "bf16", "shape": [M, N, K], "flops_per_s": 7.6e14}
    {"op": "gemm_dgrad", ...}, {"op": "gemm_wgrad", ...}
    {"op": "grouped_gemm_fwd", "dtype": "bf16", "shape": [rows, N, K, groups], ...}
    {"op": "grouped_gemm_dgrad", ...}, {"op": "grouped_gemm_wgrad", ...}
    {"op": "grouped_linear_fwd", "dtype": "fp8_rowwise", "shape": [rows, N, K, groups], ...}
    {"op": "grouped_linear_bwd", ...}
    {"op": "attention_fwd", "dtype": "bf16", "shape": [batch·heads, seq, head_dim], ...}
    {"op": "attention_bwd", ...}
    {"op": "rmsnorm", "dtype": "bf16", "shape": [rows, cols], "bytes_per_s": 1.9e12}
    {"op": "kernel_launch", "dtype": "none", "shape": [launches], "per_s": 2.1e5}
    {"op": "host_read", "dtype": "none", "shape": [reads], "per_s": 4.0e4}

GEMM dtypes are ``bf16``, ``fp32`` and ``fp8_<recipe>`` (the FP8 GEMM path that recipe takes in
mt-fp8). ``grouped_linear_fwd`` / ``_bwd`` (dtype ``bf16`` or ``fp8_<recipe>``) time one MoE
expert projection whole, as mt-parallel's ``GroupedLinear`` or ``mt_fp8.FP8GroupedLinear`` runs
it (weight casts, padding, quantization and per-expert GEMMs included), rated per
``2·rows·N·K`` FLOPs forward and ``4·rows·N·K`` backward (dgrad + wgrad); without them the cost
model prices the experts from ``grouped_gemm`` (:mod:`mt_plan.cost`). Memory-bound ops
(``rmsnorm``, ``swiglu``, ``rope``, ``cross_entropy``, ``adamw``, ``quantize``, ``permute``,
``copy``) are rated in bytes per second for the bytes the table's op convention names (below).

GEMM passes and their operand layouts. A GEMM entry's shape is the GEMM's own: an ``M×N``
output over a contraction of ``K``. A linear ``y = x·Wᵀ`` (``x`` [T, in], the weight stored
[out, in] as ``nn.Linear`` keeps it) runs three GEMMs, each with its own operand layouts, and
each pass is its own op:

* ``gemm_fwd`` [T, out, in]: ``F.linear(x, W)``, ``x`` row-major times the transposed view of
  ``W`` (column-major);
* ``gemm_dgrad`` [T, in, out]: ``dY @ W``, both row-major;
* ``gemm_wgrad`` [out, in, T]: ``dYᵀ @ x``, the transposed view of ``dY`` times ``x``.

These are the calls autograd makes for ``F.linear``; under FP8 each pass is ``mt_fp8.fp8_gemm``
on the operands ``mt_fp8.functional`` passes it (``x`` and ``W`` quantized along ``in``; ``dY``
and ``Wᵀ`` along ``out``; ``dYᵀ`` and ``xᵀ`` along ``T``, each in its role's format, the weight
gradient written in fp32, which under rowwise scaling is cuBLAS's bf16 result converted inside
the call). ``grouped_gemm_*`` are the same three passes of ``torch._grouped_mm`` as autograd
runs them for ``GroupedLinear`` (forward on the weights' transposed view, dgrad on the weights,
wgrad ``dYᵀ·x`` per group). Why per pass: the GEMM libraries pick their kernels by the
operands' memory order (and, in FP8, by their formats and the output dtype), and a linear's
three GEMMs have three different orders; a product of row-major random matrices ``a @ b`` has
dgrad's alone, so timing it for every pass prices the forward and the wgrad at another kernel's
rate (docs/plan.md, "GEMM layouts in the calibration").

Tables written before the passes were measured hold ``gemm`` and ``grouped_gemm`` entries
without one (the layout-free ops of :data:`LAYOUT_FREE`: bf16 timed as ``a @ b`` with both
operands row-major, FP8 as the forward's ``fp8_gemm``); a pass without entries of its own is
priced from those, so such tables (the shipped ``h200.json``; the shipped ``h100.json`` times
every pass) still load and price every pass, and ``--explain`` notes it.

Host costs (:data:`HOST_OPS`, rated ``per_s``: events a second). ``kernel_launch`` is the host
time to enqueue one small kernel while the device keeps up (``mt-plan calibrate`` enqueues
``launches`` of them back to back and divides), ``host_read`` one device-to-host read of a
small tensor on an idle device (``tolist()``, the round trip a ``sizes.tolist()`` costs). The
cost model's host-time floor (:mod:`mt_plan.cost`, "Host time") prices launches and reads with
them; a table without them (the shipped ``h100.json`` and ``h200.json`` predate them) takes
:data:`DEFAULT_HOST_SECONDS` (:meth:`CalibrationTable.host_seconds`).

Memory-bound rates and the calibration's harness. ``mt-plan calibrate`` times ``rmsnorm``,
``swiglu``, ``rope`` and ``cross_entropy`` as ``op(...).sum().backward()`` on leaf tensors whose
``.grad`` it never clears (:func:`mt_plan.measure._membound`), so each timed call also reads the
output for the sum, materializes the sum's expanded gradient (the fused backward's
``.contiguous()``) and accumulates the input gradient in place (read, read, write). Per element,
with ``A`` bytes per activation, the harness moves: RMSNorm (fp32 input) ``4+A`` forward, ``A``
sum, ``A`` gradient, ``4+A+4`` backward, ``12`` accumulation, ``24+4A`` in all against the
``12+2A`` an entry is rated per; RoPE on q and k ``2A + A + A + 2A + 3A = 9A`` against ``4A``;
SwiGLU ``3A + A + A + 5A + 2·3A = 16A`` against ``16A``; cross-entropy ``A + 2A + 3A = 6A``
against ``6A``. :data:`HARNESS_TRAFFIC` is the ratio, so the op's achieved bandwidth is the
entry's rate times it, and the cost model charges the bytes a training step's kernels move
(:meth:`CalibrationTable.membound_time`).

Lookup (:meth:`CalibrationTable.compute_time`, :meth:`membound_time`). For an op and dtype with
entries (for a GEMM pass without entries, its layout-free op's, above), the achieved rate is
interpolated multilinearly in the log shape between the measured shapes that bracket the asked one
in every dimension (clamped at the measured range's ends), or, where those corners were not all
measured, the rate of the nearest measured shape (Euclidean distance of the log shape); never
faster than the roofline: ``t = max(flops / rate, flops / peak, bytes / bw)``. NOTE: with the
nearest shape alone, a shape halfway between two measured ones in log (2048 between 1024 and 4096)
took whichever the table listed first, the smaller and mostly slower one. An FP8 recipe without
entries takes ``fp8_tensorwise``'s rate (again the pass's own entries first, then the layout-free
op's), any other dtype without entries the bf16 rate scaled by the ratio of the peaks
(``source = "derived"``). With nothing to derive from, the roofline alone (``flops / peak`` and
``bytes / bw``, an optimistic bound) is used and the lookup says so (``source = "roofline"``), so ``--explain``
shows which parts of a prediction are measured. ``mt-plan calibrate`` (:mod:`mt_plan.measure`)
writes tables; ``mt_plan/data/calibration/h100.json`` and ``h200.json`` ship the H100's and the
H200's.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

MEMBOUND_OPS = (
    "rmsnorm",
    "swiglu",
    "rope",
    "cross_entropy",
    "adamw",
    "quantize",
    "permute",
    "copy",
)
HOST_OPS = ("kernel_launch", "host_read")
"""Host costs, rated in events a second (module docstring, "Host costs")."""
DEFAULT_HOST_SECONDS = {"kernel_launch": 10.0e-6, "host_read": 30.0e-6}
"""Seconds per event where a table has no host entry. Assumed, not measured on a GPU (none was
lent when the entries were added, 2026-12-08): 10 µs is of the order of one eager PyTorch op
from Python (the development machine's CPU enqueued a small in-place add in 9 to 11 µs, its own
kernel included), 30 µs a launch, a small device-to-host copy and the stream's wait.
``mt-plan calibrate`` measures both; a recalibrated table replaces them."""
GEMM_PASSES = ("fwd", "dgrad", "wgrad")
"""A linear's three GEMMs (module docstring, "GEMM passes")."""


def gemm_pass_shapes(M: int, N: int, K: int) -> dict[str, tuple[int, int, int]]:
    """The GEMM shape ``[rows, cols, contraction]`` of each pass of a linear of ``M`` tokens,
    ``N`` outputs and ``K`` inputs (module docstring, "GEMM passes")."""
    return {"fwd": (M, N, K), "dgrad": (M, K, N), "wgrad": (N, K, M)}


LAYOUT_FREE = {
    f"{gemm}_{gemm_pass}": gemm for gemm in ("gemm", "grouped_gemm") for gemm_pass in GEMM_PASSES
}
"""Each GEMM pass op and the op of tables measured before the passes, whose rates price it when
the table has no entries of the pass (module docstring)."""
COMPUTE_OPS = (
    *LAYOUT_FREE,
    "gemm",
    "grouped_gemm",
    "grouped_linear_fwd",
    "grouped_linear_bwd",
    "attention_fwd",
    "attention_bwd",
)
HARNESS_TRAFFIC = {"rmsnorm": 2.0, "rope": 9 / 4}
"""Bytes a memory-bound op's calibration moved per byte its entry is rated per: RMSNorm
``(24+4A)/(12+2A)``, RoPE ``9A/4A`` (module docstring, "Memory-bound rates"); 1 for the others.
The ratios do not depend on ``A``, so they hold for bf16 (GPU) and fp32 (CPU) tables alike."""
FP8_REFERENCE = "fp8_tensorwise"
"""The FP8 dtype whose rate stands in for an FP8 recipe without entries of its own."""


@dataclass(frozen=True)
class Entry:
    op: str
    dtype: str
    shape: tuple[int, ...]
    rate: float
    """FLOP/s for compute ops, bytes/s for memory-bound ones, events/s for host ones."""


@dataclass
class CalibrationTable:
    """Measured rates by (op, dtype) (module docstring)."""

    device: str
    entries: list[Entry] = field(default_factory=list)
    source: str = ""
    _by_key: dict[tuple[str, str], list[tuple[tuple[float, ...], float]]] = field(
        default_factory=dict, repr=False
    )
    _grid: dict[tuple[str, str], _Grid | None] = field(default_factory=dict, repr=False)
    _cache: dict[tuple, tuple[float, str]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for e in self.entries:
            if e.op not in COMPUTE_OPS + MEMBOUND_OPS + HOST_OPS:
                valid = ", ".join(COMPUTE_OPS + MEMBOUND_OPS + HOST_OPS)
                raise ValueError(f"calibration entry op={e.op!r}; valid: {valid}")
            if not e.rate > 0 or not e.shape or min(e.shape) < 1:
                raise ValueError(f"calibration entry {e} needs a positive rate and shape")
            key = (e.op, e.dtype)
            logs = tuple(math.log2(d) for d in e.shape)
            self._by_key.setdefault(key, []).append((logs, e.rate))
        for key, measured in self._by_key.items():
            self._grid[key] = _Grid.of(measured)

    def has(self, op: str, dtype: str) -> bool:
        return (op, dtype) in self._by_key

    def _rate(self, op: str, dtype: str, shape: tuple[int, ...]) -> float | None:
        measured = self._by_key.get((op, dtype))
        if not measured:
            return None
        logs = tuple(math.log2(max(d, 1)) for d in shape)
        grid = self._grid[(op, dtype)]
        interpolated = None if grid is None else grid.interpolate(logs)
        if interpolated is not None:
            return interpolated
        best = min(
            measured,
            key=lambda m: sum((a - b) ** 2 for a, b in zip(m[0], logs, strict=False)),
        )
        return best[1]

    def _pass_rate(self, op: str, dtype: str, shape: tuple[int, ...]) -> float | None:
        """``op``'s rate, or for a GEMM pass without entries its layout-free op's (module
        docstring, "GEMM passes")."""
        rate = self._rate(op, dtype, shape)
        if rate is None and op in LAYOUT_FREE:
            rate = self._rate(LAYOUT_FREE[op], dtype, shape)
        return rate

    def has_gemm(self, dtype: str) -> bool:
        """Whether the table measured dense GEMMs at ``dtype`` (any pass, or layout-free)."""
        return any(self.has(op, dtype) for op in ("gemm", *(f"gemm_{p}" for p in GEMM_PASSES)))

    def layout_free(self, op: str, dtype: str) -> bool:
        """Whether GEMM pass ``op`` at ``dtype`` is priced from a layout-free op's entries
        (a table measured before the passes; module docstring)."""
        return op in LAYOUT_FREE and not self.has(op, dtype) and self.has(LAYOUT_FREE[op], dtype)

    def compute_time(
        self,
        op: str,
        dtype: str,
        shape: tuple[int, ...],
        flops: float,
        bytes_moved: float,
        peak_flops: float,
        bandwidth: float,
        bf16_peak: float | None = None,
    ) -> tuple[float, str]:
        """(seconds, source) of a compute op: ``measured``, ``derived`` or ``roofline``
        (module docstring); ``bf16_peak`` scales a bf16 rate to another dtype's peak."""  # fmt: skip
        bf16_peak = bf16_peak or peak_flops
        key = (op, dtype, shape, flops, bytes_moved)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        roof = max(flops / peak_flops, bytes_moved / bandwidth)
        rate, source = self._pass_rate(op, dtype, shape), "measured"
        if rate is None and dtype.startswith("fp8_"):
            rate, source = self._pass_rate(op, FP8_REFERENCE, shape), "derived"
        if rate is None and dtype != "bf16":
            bf16 = self._pass_rate(op, "bf16", shape)
            if bf16 is not None:
                rate, source = bf16 * peak_flops / bf16_peak, "derived"
        result = (roof, "roofline") if rate is None else (max(flops / rate, roof), source)
        self._cache[key] = result
        return result

    def membound_time(
        self, op: str, dtype: str, shape: tuple[int, ...], bytes_moved: float, bandwidth: float
    ) -> tuple[float, str]:
        """(seconds, source) of a memory-bound op whose kernels move ``bytes_moved`` bytes, at
        the bandwidth its calibration achieved: the entry's rate times :data:`HARNESS_TRAFFIC`
        (the harness moved that much more than the entry is rated per), else copy's rate."""
        rate = self._rate(op, dtype, shape)
        if rate is not None:
            rate *= HARNESS_TRAFFIC.get(op, 1.0)
        else:
            rate = self._rate("copy", "bf16", shape)
        if rate is None:
            return bytes_moved / bandwidth, "roofline"
        return max(bytes_moved / rate, bytes_moved / bandwidth), "measured"

    def host_seconds(self, op: str) -> tuple[float, str]:
        """(seconds per event, source) of host op ``op``: the table's rate at its largest
        measured count (``measured``), else :data:`DEFAULT_HOST_SECONDS` (``default``)."""
        if op not in HOST_OPS:
            raise ValueError(f"host op {op!r}; valid: {', '.join(HOST_OPS)}")
        measured = [e for e in self.entries if e.op == op]
        if not measured:
            return DEFAULT_HOST_SECONDS[op], "default"
        return 1.0 / max(measured, key=lambda e: e.shape).rate, "measured"

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "source": self.source,
            "entries": [
                {"op": e.op, "dtype": e.dtype, "shape": list(e.shape), _rate_key(e.op): e.rate}
                for e in self.entries
            ],
        }


def _rate_key(op: str) -> str:
    """The JSON field of ``op``'s rate."""
    if op in HOST_OPS:
        return "per_s"
    return "bytes_per_s" if op in MEMBOUND_OPS else "flops_per_s"


def table_from_dict(data: dict[str, Any]) -> CalibrationTable:
    """A table from its JSON form; a malformed entry is named."""
    entries = []
    for i, raw in enumerate(data.get("entries", [])):
        try:
            rate = raw[_rate_key(raw["op"])]
            entries.append(
                Entry(raw["op"], raw["dtype"], tuple(int(d) for d in raw["shape"]), rate)
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"calibration entry {i} ({raw!r}) is malformed: {error!r}") from None
    return CalibrationTable(data.get("device", "unknown"), entries, data.get("source", ""))


def load_table(name_or_path: str | None) -> CalibrationTable:
    """A shipped table by device name (``h200``), a JSON path, or an empty table (None)."""
    if name_or_path is None:
        return CalibrationTable("none")
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"calibration file {name_or_path} does not exist")
        return table_from_dict(json.loads(path.read_text()))
    folder = resources.files("mt_plan") / "data" / "calibration"
    shipped = sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )
    if name_or_path not in shipped:
        raise ValueError(
            f"unknown calibration table {name_or_path!r}; shipped: {', '.join(shipped)}, or a "
            "JSON path written by mt-plan calibrate"
        )
    return table_from_dict(json.loads((folder / f"{name_or_path}.json").read_text()))


@dataclass(frozen=True)
class _Grid:
    """One op and dtype's measured shapes as a grid in log shape (module docstring, lookup)."""

    rates: dict[tuple[float, ...], float]
    axes: tuple[tuple[float, ...], ...]
    """The measured values of each dimension, ascending."""

    @classmethod
    def of(cls, measured: list[tuple[tuple[float, ...], float]]) -> _Grid | None:
        if len({len(logs) for logs, _ in measured}) != 1:
            return None
        dims = len(measured[0][0])
        axes = tuple(tuple(sorted({logs[d] for logs, _ in measured})) for d in range(dims))
        return cls(dict(measured), axes)

    def interpolate(self, logs: tuple[float, ...]) -> float | None:
        """The rate multilinear in log shape between the measured shapes that bracket ``logs``
        in every dimension (clamped at the grid's ends); None unless every bracketing corner
        was measured, or ``logs`` has another number of dimensions."""
        if len(logs) != len(self.axes):
            return None
        corners = []
        for values, q in zip(self.axes, logs, strict=True):
            lo = max((v for v in values if v <= q), default=values[0])
            hi = min((v for v in values if v >= q), default=values[-1])
            if hi == lo:
                corners.append(((lo, 1.0),))
            else:
                t = (q - lo) / (hi - lo)
                corners.append(((lo, 1.0 - t), (hi, t)))
        total = 0.0
        for corner in itertools.product(*corners):
            rate = self.rates.get(tuple(v for v, _ in corner))
            if rate is None:
                return None
            total += math.prod(w for _, w in corner) * rate
        return total
