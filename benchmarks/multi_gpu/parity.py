"""mt-parallel parity on several devices: every layer and the decoder block at tp/cp/dp layouts,
against the single-process float64 reference, as a PASS/FAIL table.

One process per device under ``torchrun``; the backend follows the device (NCCL on CUDA, gloo on
the CPU), so the same script is the GPU run and its CPU rehearsal::

    # N GPUs, NVLink multicast off (docs/multi_gpu.md says why)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node N benchmarks/multi_gpu/parity.py --layouts auto
    # the rehearsal: 4 CPU processes on gloo
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/multi_gpu/parity.py --device cpu

Layouts are written ``dp2-cp2-tp2-sp`` (``sp``: sequence parallel); dp may be left out and then
takes the rest of the world, so ``tp2`` on 8 processes is dp=4 × tp=2. ``auto`` is tp=2, tp=2
with SP, cp=2, dp=N, and for N ≥ 4 the largest combination dp=N/4 × cp=2 × tp=2 with SP, tp=N
with SP and cp=N.

The checks are the worker functions of the CPU test suite (``packages/mt-parallel/tests``:
``parallel_checks.py``, ``sequence_checks.py``, ``moe_checks.py``), run on this process's
device: each rank runs the parallel computation in fp32 on its device and the same model on
one process in float64 on its host CPU (the reference; on CUDA the fused Triton ops compute in fp32 whatever the input
dtype, so a float64 GPU model would not be a float64 reference), and reports the largest
relative error ``max|a − b| / max|b|`` of the outputs, the loss and every parameter gradient.

Bounds (``parallel_tolerances.py``): ``FP32_VS_FP64`` = 1e-5. fp32 on the GPU rounds like fp32
on the CPU (u = 2⁻²⁴) as long as nothing runs in TF32: this script turns TF32 off for matmuls
and cuDNN, and asks for ``highest`` fp32 matmul precision. The compared values are short chains
(≤ 2 blocks) of dot products of length ≤ 64, softmaxes and norms, which land near 1e-7..1e-6;
1e-5 leaves a 10× margin for other reduction orders (NCCL's ring/tree sums, other GEMM tilings)
and is 3–4 orders of magnitude below what a wrong shard, a missing or doubled reduction or a
wrong causal offset produces. If a GPU run fails with errors around 1e-4..1e-3 in attention
only, rerun with ``--sdpa math`` to tell an attention kernel's internal precision from a
parallelism bug. The ZeRO-1 check compares float64 runs (``FP64_VS_FP64`` = 1e-10) and on CUDA
runs with ``MT_FP8_DISABLE_TRITON=1`` for that reason. FP8 checks compare with the FP8 error
bound (a ratio ≤ 1) and, for the TP-vs-tp=1 FP8 results, fp32 summation order.

Exit status 0 when every applicable check passed. A check that raises is a FAIL with the error;
a check that raises on some ranks only can leave the others in a collective until
``--timeout-s`` (the collective timeout), after which they fail too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # the shared harness
import harness  # noqa: E402

TESTS = REPO / "packages" / "mt-parallel" / "tests"
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
SEQ = 16  # tokens per row in the decoder checks (parallel_checks._batch(..., 16))


# ----------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    dp: int
    cp: int
    tp: int
    sp: bool

    @property
    def name(self) -> str:
        return f"dp{self.dp}-cp{self.cp}-tp{self.tp}" + ("-sp" if self.sp else "")


def parse_layout(text: str, world: int) -> Layout:
    """``dp2-cp2-tp2-sp`` (any order; dp inferred when absent) for a world of ``world``."""
    degrees: dict[str, int | None] = {"dp": None, "cp": 1, "tp": 1}
    sp = False
    for token in text.strip().lower().split("-"):
        match = re.fullmatch(r"(dp|cp|tp)(\d+)", token)
        if token == "sp":
            sp = True
        elif match:
            degrees[match.group(1)] = int(match.group(2))
        else:
            raise ValueError(f"layout {text!r}: cannot read {token!r} (write e.g. dp2-cp2-tp2-sp)")
    cp, tp = degrees["cp"], degrees["tp"]
    assert cp is not None and tp is not None
    if cp < 1 or tp < 1 or world % (cp * tp):
        raise ValueError(f"layout {text!r}: cp·tp = {cp * tp} does not divide the world {world}")
    dp = degrees["dp"] if degrees["dp"] is not None else world // (cp * tp)
    if dp * cp * tp != world:
        raise ValueError(f"layout {text!r}: dp·cp·tp = {dp * cp * tp} is not the world {world}")
    if sp and tp == 1:
        raise ValueError(f"layout {text!r}: sequence parallel needs tp > 1")
    return Layout(dp, cp, tp, sp)


def auto_layouts(world: int) -> list[str]:
    """tp=2, tp=2+SP, cp=2, dp=N; for N ≥ 4 also dp=N/4×cp=2×tp=2+SP, tp=N+SP and cp=N."""
    if world == 1:
        return ["dp1"]
    names = ["tp2", "tp2-sp", "cp2", f"dp{world}"]
    if world >= 4 and world % 4 == 0:
        names += [f"dp{world // 4}-cp2-tp2-sp", f"tp{world}-sp", f"cp{world}"]
    return names


# ----------------------------------------------------------------------------- init
def init_distributed(device: str, pg: str, timeout_s: float) -> Any:
    """``mt_comm.init_distributed``; with ``pg="device+gloo"`` the default group is created
    first as ``cpu:gloo,cuda:nccl`` (so collectives on CPU tensors have a backend under NCCL)
    and mt_comm adopts it. Shared with throughput.py."""
    import torch
    import torch.distributed as dist

    import mt_comm

    timeout = datetime.timedelta(seconds=timeout_s)
    if pg == "device+gloo" and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = device in ("auto", "cuda") and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
            timeout=timeout,
            device_id=torch.device("cuda", local_rank) if cuda else None,
        )
    return mt_comm.init_distributed(device=device, timeout=timeout)


# ----------------------------------------------------------------------------- checks
def _floats(value: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every float of a (nested) result, with its path (booleans and tensors are not floats)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _floats(item, f"{path}/{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _floats(item, f"{path}[{index}]")
    elif isinstance(value, float):
        yield path, value


def _worst(results: list[Any], skip: tuple[str, ...] = ()) -> tuple[str, float]:
    """The largest float over all ranks (path prefixed by the rank)."""
    worst = ("—", 0.0)
    for rank, result in enumerate(results):
        for path, value in _floats(result):
            if path.split("/")[0] in skip:
                continue
            if math.isnan(worst[1]):
                return worst  # NaN is the worst there is
            if math.isnan(value) or value > worst[1]:
                worst = (f"r{rank}:{path}", value)
    return worst


@dataclass
class Verdict:
    ok: bool
    worst: str
    value: float
    bound: float
    note: str = ""


def within(results: list[Any], bound: float, skip: tuple[str, ...] = ()) -> Verdict:
    path, value = _worst(results, skip)
    return Verdict(value < bound, path, value, bound)


def require(verdict: Verdict, results: list[Any], keys: tuple[str, ...]) -> Verdict:
    """``verdict`` with every boolean ``keys`` of every rank required True."""
    for rank, result in enumerate(results):
        for key in keys:
            if not result[key]:
                verdict.ok = False
                verdict.note += f" r{rank}:{key}=False"
    return verdict


def eval_tp_layers(results: list[Any], tol: Any) -> Verdict:
    verdict = within(results, tol.FP32_VS_FP64)
    for rank, result in enumerate(results):
        if result["init"] != 0.0:
            verdict.ok, verdict.note = False, f"{verdict.note} r{rank}:init={result['init']:.1e}"
        if not result["ce_vs_torch"] < tol.FP64_VS_FP64:
            verdict.ok = False
            verdict.note += f" r{rank}:ce_vs_torch={result['ce_vs_torch']:.1e}"
    return verdict


def eval_fp8(results: list[Any], tol: Any) -> Verdict:
    import torch

    ratio = within([{n: {k: r[n][k] for k in ("y", "dx", "dw")} for n in ("col", "row")}
                    for r in results], 1.0 + 1e-12)  # fmt: skip
    ratio.bound = 1.0
    exact = within(
        [{n: {"db": r[n]["db"], **r[n]["vs_tp1_fp8"]} for n in ("col", "row")} for r in results],
        tol.FP32_VS_FP64,
    )
    verdict = ratio if not ratio.ok else exact
    verdict.note = f"fp8 bound ratio {ratio.value:.2f} (≤ 1); vs fp32/tp=1 {exact.value:.1e}"
    verdict.ok = ratio.ok and exact.ok
    for rank, result in enumerate(results):
        if not result["fp8"] or not all(result[n]["not_exact"] for n in ("col", "row")):
            verdict.ok, verdict.note = False, verdict.note + f" r{rank}: FP8 path did not run"
        for n in ("col", "row"):
            for key in ("y_bytes", "dx_bytes"):
                if not torch.equal(result[n][key], results[0][n][key]):
                    verdict.ok, verdict.note = False, verdict.note + f" r{rank}:{n}/{key}≠r0"
            if not torch.equal(result["delayed_scales"][n], results[0]["delayed_scales"][n]):
                verdict.ok, verdict.note = False, verdict.note + f" r{rank}:{n} scales≠r0"
    return verdict


def eval_zero1(results: list[Any], tol: Any) -> Verdict:
    values = [{"params": r["params"], "norms": r["norms"]} for r in results]
    return require(within(values, tol.FP64_VS_FP64), results, ("clipped",))


def eval_recompute(results: list[Any], tol: Any) -> Verdict:
    verdict = within([{"max_rel": r["max_rel"]} for r in results], float("inf"))
    verdict.bound = 0.0
    verdict.note = "bit-identical required"
    return require(verdict, results, ("identical",))


def eval_dropout(results: list[Any], tol: Any, layout: Layout) -> Verdict:
    """Ranks 0..tp-1 form the first TP group (tp is the fastest dimension)."""
    import torch

    group = results[: layout.tp]
    problems = []
    for rank, result in enumerate(group):
        if "needs mt_parallel.manual_seed" not in result["unseeded"]:
            problems.append(f"r{rank}: unseeded dropout did not raise")
        if result["block_sharded_sp=False"] or not result["block_sharded_sp=True"]:
            problems.append(f"r{rank}: block dropout region")
        for key in ("replicated_before", "replicated_after", "default_state"):
            if not torch.equal(result[key], group[0][key]):
                problems.append(f"r{rank}:{key} differs from r0 (must agree)")
        if rank > 0:
            for key in ("sharded", "sequence_parallel", "attention_output"):
                if torch.equal(result[key], group[0][key]):
                    problems.append(f"r{rank}:{key} equals r0 (must differ)")
    for key in ("replicated_before", "sharded", "sequence_parallel"):
        fraction = float(group[0][key].float().mean())
        if not 0.3 < fraction < 0.7:
            problems.append(f"{key} keeps {fraction:.2f} (p=0.5)")
    return Verdict(not problems, "masks", float(len(problems)), 0.0, "; ".join(problems))


@dataclass
class Check:
    name: str
    module: str  # parallel_checks, sequence_checks or moe_checks
    function: str
    kwargs: Callable[[Layout], dict[str, Any]]
    skip: Callable[[Layout], str | None]
    evaluate: Callable[..., Verdict]
    env: dict[str, str] | None = None  # extra environment on CUDA
    needs_layout: bool = False


def _need(condition: bool, reason: str) -> str | None:
    return None if condition else reason


def _decoder_skip(layout: Layout) -> str | None:
    if SEQ % (2 * layout.cp) or (SEQ // layout.cp) % (layout.tp if layout.sp else 1):
        return f"sequence {SEQ} does not split over cp={layout.cp}, tp={layout.tp}"
    return None


def _heads(layout: Layout) -> dict[str, int]:
    # DIM is 32: 4 query / 2 KV heads by default, more for tp=4 or 8 (head dim ≥ 4).
    return {"heads": max(4, layout.tp), "kv_heads": max(2, layout.tp)}


def _fp32(results: list[Any], tol: Any) -> Verdict:
    return within(results, tol.FP32_VS_FP64)


def eval_moe_sp(results: list[Any], tol: Any) -> Verdict:
    """Errors within the fp32 bound ("losses" are values, not errors) and the expert counts and
    the aux-loss-free bias equal to the reference's."""
    verdict = within(results, tol.FP32_VS_FP64, skip=("losses",))
    return require(verdict, results, ("counts_equal", "step_counts_equal", "bias_equal"))


# DeepSeek-style routing (sigmoid, group-limited, sequence-aux loss, shared experts) for moe_sp.
MOE_SP = {"score_function": "sigmoid", "n_group": 4, "topk_group": 2,
          "balancing": "seq_aux_loss", "n_shared_experts": 2, "dtype": "float32"}  # fmt: skip


def checks(fp8_backend: str) -> list[Check]:
    def decoder(layout: Layout, **extra: Any) -> dict[str, Any]:
        return {"dp": layout.dp, "cp": layout.cp, "tp": layout.tp, "sp": layout.sp,
                **_heads(layout), **extra}  # fmt: skip

    tp_needed = lambda lay: _need(lay.tp > 1, "needs tp > 1")  # noqa: E731
    cp_needed = lambda lay: _need(lay.cp > 1, "needs cp > 1")  # noqa: E731
    # These checks build their model with 2 KV heads (parallel_checks.KV_HEADS): tp ≤ 2.
    kv2 = lambda lay: _need(lay.tp <= 2, "its model has 2 KV heads: tp ≤ 2")  # noqa: E731
    return [
        Check("tp_layers", "parallel_checks", "tp_layers",
              lambda lay: {"sp": False, "tp": lay.tp, "cp": lay.cp}, tp_needed, eval_tp_layers),
        Check("tp_layers_sp", "parallel_checks", "tp_layers",
              lambda lay: {"sp": True, "tp": lay.tp, "cp": lay.cp}, tp_needed, eval_tp_layers),
        Check("fp8_tp", "parallel_checks", "fp8_tp",
              lambda lay: {"tp": lay.tp, "cp": lay.cp, "backend": fp8_backend}, tp_needed,
              eval_fp8),
        Check("dropout_regions", "sequence_checks", "dropout_masks",
              lambda lay: {"tp": lay.tp},
              lambda lay: tp_needed(lay) or _need(lay.cp == 1, "needs cp = 1") or kv2(lay),
              eval_dropout, needs_layout=True),
        Check("cp_attention", "parallel_checks", "cp_attention",
              lambda lay: {"cp": lay.cp, "tp": lay.tp}, cp_needed, _fp32),
        Check("cp_attention_documents", "sequence_checks", "cp_attention_documents",
              lambda lay: {"cp": lay.cp, "tp": lay.tp}, cp_needed, _fp32),
        Check("ring_attention", "sequence_checks", "ring_attention",
              lambda lay: {"documents": False, "cp": lay.cp, "tp": lay.tp}, cp_needed, _fp32),
        Check("ring_attention_documents", "sequence_checks", "ring_attention",
              lambda lay: {"documents": True, "cp": lay.cp, "tp": lay.tp}, cp_needed, _fp32),
        Check("decoder_block", "parallel_checks", "decoder_lm",
              decoder, _decoder_skip, _fp32),
        Check("decoder_block_ring", "parallel_checks", "decoder_lm",
              lambda lay: decoder(lay, cp_attention="ring"),
              lambda lay: cp_needed(lay) or _decoder_skip(lay), _fp32),
        Check("decoder_block_documents", "sequence_checks", "decoder_lm_documents",
              lambda lay: {"cp": lay.cp, "tp": lay.tp, "sp": lay.sp, **_heads(lay)},
              _decoder_skip, _fp32),
        Check("decoder_block_documents_flex", "sequence_checks", "decoder_lm_documents",
              lambda lay: {"cp": lay.cp, "tp": lay.tp, "sp": lay.sp, "kernel": "flex",
                           **_heads(lay)},
              _decoder_skip, _fp32),
        Check("decoder_block_fsdp", "parallel_checks", "decoder_lm",
              lambda lay: decoder(lay, data_parallel="fsdp"),
              lambda lay: _need(lay.dp * lay.cp > 1, "needs dp·cp > 1") or _decoder_skip(lay),
              _fp32),
        Check("dp_accumulation", "parallel_checks", "dp_accumulation",
              lambda lay: {"micro_batches": 4},
              lambda lay: _need(lay.dp > 1 and lay.tp == lay.cp == 1, "needs a pure dp layout"),
              lambda res, tol: require(_fp32(res, tol), res, ("unreduced",))),
        Check("clip_norm", "parallel_checks", "clip_norm",
              lambda lay: {"tp": lay.tp, "dp": lay.dp, "sp": lay.sp},
              lambda lay: _need(lay.cp == 1, "needs cp = 1") or kv2(lay),
              lambda res, tol: require(_fp32(res, tol), res, ("clipped",))),
        Check("clip_norm_fsdp", "parallel_checks", "clip_norm",
              lambda lay: {"tp": lay.tp, "dp": lay.dp, "sp": lay.sp, "data_parallel": "fsdp"},
              lambda lay: _need(lay.cp == 1 and lay.dp > 1, "needs cp = 1, dp > 1") or kv2(lay),
              lambda res, tol: require(_fp32(res, tol), res, ("clipped",))),
        Check("zero1", "parallel_checks", "zero1_steps",
              lambda lay: {"steps": 3, "tp": lay.tp},
              lambda lay: _need(lay.cp == 1 and lay.dp > 1, "needs cp = 1, dp > 1") or kv2(lay),
              eval_zero1, env={"MT_FP8_DISABLE_TRITON": "1"}),
        # moe_checks' micro-batch has 6 tokens per sequence: they split over tp = 2.
        Check("moe_sp", "moe_checks", "sp_parity", lambda lay: {"tp": lay.tp, **MOE_SP},
              lambda lay: _need(lay.sp and lay.tp == 2 and lay.cp == 1,
                                "needs tp = 2 with sequence parallel, cp = 1"),
              eval_moe_sp),
        Check("recompute_full", "parallel_checks", "recompute_bits",
              lambda lay: {"policy": "full", "tp": lay.tp, "sp": lay.sp},
              lambda lay: tp_needed(lay) or _need(lay.cp == 1, "needs cp = 1") or kv2(lay),
              eval_recompute),
        Check("recompute_selective", "parallel_checks", "recompute_bits",
              lambda lay: {"policy": "selective", "tp": lay.tp, "sp": lay.sp},
              lambda lay: tp_needed(lay) or _need(lay.cp == 1, "needs cp = 1") or kv2(lay),
              eval_recompute),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- running
class KeptGroups:
    """Build each layout's process groups once and keep them for the whole run.

    The worker functions call ``mt_comm.init_parallel_state`` themselves; between checks the
    test pools call ``mt_comm.destroy_parallel_state``, which destroys the groups. Here the
    groups stay alive (as in training) and a later check with the same degrees gets the same
    :class:`~mt_comm.ParallelState` back. Why: torch's DTensor machinery treats device meshes
    over the same ranks as equal whatever their process group, so after a group is destroyed
    and a new one with the same ranks is created, FSDP2 picks up the old mesh and fails with
    "Could not resolve the process group registered under the name N" (reproduced on gloo at
    4 processes: fully_shard twice over the dp group of a tp=2 layout, with the groups
    destroyed in between).
    """

    def __init__(self) -> None:
        import mt_comm
        from mt_comm import parallel_state

        self._module = parallel_state
        self._build = parallel_state.init_parallel_state
        self._kept: dict[Any, Any] = {}
        mt_comm.init_parallel_state = self.init  # what the worker functions call
        parallel_state.init_parallel_state = self.init

    def init(self, dp: int | None = None, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1):
        import mt_comm

        world = mt_comm.get_distributed_context().world_size
        if dp is None:
            dims = mt_comm.ParallelDims.infer_dp(world, cp=cp, tp=tp, pp=pp, ep=ep)
        else:
            dims = mt_comm.ParallelDims(world, dp=dp, cp=cp, tp=tp, pp=pp, ep=ep)
        if dims not in self._kept:
            self._module._state = None
            self._kept[dims] = self._build(dp=dims.dp, cp=cp, tp=tp, pp=pp, ep=ep)
        self._module._state = self._kept[dims]
        return self._kept[dims]

    def forget(self) -> None:
        """Between checks: no current state, groups kept."""
        self._module._state = None


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


@contextlib.contextmanager
def _environment(extra: dict[str, str] | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra or {}}
    os.environ.update(extra or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_check(
    check: Check, layout: Layout, device_type: str, sdpa_math: bool, groups: KeptGroups
) -> tuple[bool, Any]:
    """Run ``check`` on this rank: (True, result on the CPU) or (False, the error's last line)."""
    import importlib

    module = importlib.import_module(check.module)
    function = getattr(module, check.function)
    attention: Any = contextlib.nullcontext()
    if sdpa_math:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)
    try:
        with attention, _environment(check.env if device_type != "cpu" else None):
            return True, _to_cpu(function(**check.kwargs(layout)))
    except Exception:
        text = traceback.format_exc()
        print(f"[rank {os.environ.get('RANK', '?')}] {check.name} @ {layout.name}:\n{text}",
              file=sys.stderr, flush=True)  # fmt: skip
        return False, text.strip().splitlines()[-1]
    finally:
        groups.forget()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", help="auto (the accelerator if any), cuda, cpu")
    parser.add_argument("--layouts", default="auto", help="comma-separated, or auto")
    parser.add_argument("--checks", default="all", help="comma-separated check names, or all")
    parser.add_argument("--fp8-backend", default="emulate", help="mt_fp8 backend for fp8_tp")
    parser.add_argument("--sdpa", choices=("default", "math"), default="default")
    parser.add_argument("--timeout-s", type=float, default=300, help="collective timeout")
    parser.add_argument(
        "--pg",
        choices=("device", "device+gloo"),
        default="device",
        help="device: mt_comm's init (NCCL only on GPUs); device+gloo: cpu:gloo,cuda:nccl",
    )
    parser.add_argument("--out", default=None, help="JSON lines file for the rows (rank 0)")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    args = parser.parse_args(argv)

    all_checks = checks(args.fp8_backend)
    if args.list:
        print("\n".join(c.name for c in all_checks))
        return 0
    for key, value in NO_MULTICAST.items():
        if os.environ.setdefault(key, value) != value:
            print(f"parity.py: refusing to run with {key}={os.environ[key]} (NVLink multicast "
                  f"must stay off here: set {key}={value})", file=sys.stderr)  # fmt: skip
            return 2
    sys.path.insert(0, str(TESTS))
    # torch 2.13 deprecates DDP's broadcast_buffers, which mt_parallel passes: once per rank and
    # wrap is noise in this table (the library change is reported separately).
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*is deprecated")

    import parallel_tolerances as tol
    import torch
    import torch.distributed as dist

    import mt_comm

    ctx = init_distributed(args.device, args.pg, args.timeout_s)
    if not ctx.has_process_group:
        print("parity.py: no process group; launch with torchrun", file=sys.stderr)
        return 2
    device_type = ctx.device.type
    groups = KeptGroups()
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    world, rank = ctx.world_size, ctx.rank
    names = auto_layouts(world) if args.layouts == "auto" else args.layouts.split(",")
    layouts = [parse_layout(name, world) for name in names]
    wanted = None if args.checks == "all" else set(args.checks.split(","))
    unknown = (wanted or set()) - {c.name for c in all_checks}
    if unknown:
        raise SystemExit(f"unknown checks {sorted(unknown)}; --list shows them")
    selected = [c for c in all_checks if wanted is None or c.name in wanted]

    if rank == 0:
        hw = torch.cuda.get_device_name() if device_type == "cuda" else "cpu"
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if device_type == "cuda" else "—"
        print(f"# parity: {world} × {hw}, backend {ctx.backend.name if ctx.backend else '—'}, "
              f"pg {args.pg}, torch {torch.__version__}, NCCL {nccl}, NCCL_NVLS_ENABLE="
              f"{os.environ.get('NCCL_NVLS_ENABLE')}, sdpa {args.sdpa}, fp8 backend "
              f"{args.fp8_backend}; layouts {', '.join(lay.name for lay in layouts)}",
              flush=True)  # fmt: skip
    rows = []
    began = time.perf_counter()
    for layout in layouts:
        for check in selected:
            reason = check.skip(layout)
            row: dict[str, Any] = {"layout": layout.name, "check": check.name}
            if reason is not None:
                row.update(result="skip", detail=reason)
                rows.append(row)
                continue
            start = time.perf_counter()
            ok, value = run_check(check, layout, device_type, args.sdpa == "math", groups)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (ok, value))
            seconds = time.perf_counter() - start
            failed = [(r, v) for r, (good, v) in enumerate(gathered) if not good]
            if failed:
                row.update(result="FAIL", detail=f"raised on ranks {[r for r, _ in failed]}: "
                           f"{failed[0][1][:160]}")  # fmt: skip
            else:
                results = [v for _, v in gathered]
                if check.needs_layout:
                    verdict = check.evaluate(results, tol, layout)
                else:
                    verdict = check.evaluate(results, tol)
                row.update(
                    result="PASS" if verdict.ok else "FAIL",
                    worst=verdict.value,
                    where=verdict.worst,
                    bound=verdict.bound,
                    detail=verdict.note.strip(),
                )
            row["seconds"] = round(seconds, 2)
            rows.append(row)
            if rank == 0:
                harness.emit(row, args.out)
    failures = sum(r["result"] == "FAIL" for r in rows)
    if rank == 0:
        print("\n| layout | check | result | worst error | bound | where | s |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
        for r in rows:
            if r["result"] == "skip":
                continue
            worst = f"{r['worst']:.1e}" if "worst" in r else "—"
            bound = f"{r['bound']:.0e}" if "bound" in r else "—"
            where = r.get("where", "") + (f" {r['detail']}" if r.get("detail") else "")
            print(f"| {r['layout']} | {r['check']} | {r['result']} | {worst} | {bound} | "
                  f"{where} | {r['seconds']:.1f} |")  # fmt: skip
        passed = sum(r["result"] == "PASS" for r in rows)
        skipped = sum(r["result"] == "skip" for r in rows)
        print(f"\n{passed} passed, {failures} failed, {skipped} not applicable, "
              f"{time.perf_counter() - began:.0f} s: {'PASS' if not failures else 'FAIL'}",
              flush=True)  # fmt: skip
    # Every rank tears down together, after rank 0's table: a rank that exits while rank 0 still
    # holds live gloo connections can make rank 0 abort at exit ("terminate called without an
    # active exception", seen once in CI after every check had passed).
    dist.barrier()
    mt_comm.destroy_distributed()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
