"""The multi-GPU parity launcher (``benchmarks/multi_gpu/parity.py``) rehearsed on the CPU.

One ``torchrun`` of the very script a multi-GPU machine runs, on 4 gloo processes with small
shapes: layouts dp2×tp2 with sequence parallel, dp2×cp2, dp=4 and cp2×tp2 with SP, and the
layer, attention, decoder-block and MoE (tp=2 with SP) checks that apply to each. It proves
the launcher (layout parsing, group handling, result gathering, the PASS/FAIL table and the
exit status) and the device-agnostic worker functions under torchrun rather than the test
pool. The GPU variant
(marked ``gpu``, at least 2 GPUs) runs the same command with NCCL on every visible GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "multi_gpu" / "parity.py"
LAYOUTS = "tp2-sp,cp2,dp4,dp1-cp2-tp2-sp"
CHECKS = (
    "tp_layers,tp_layers_sp,fp8_tp,cp_attention,ring_attention,decoder_block,"
    "decoder_block_ring,decoder_block_fsdp,dp_accumulation,zero1,recompute_full,moe_sp"
)
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _parity_module():
    spec = importlib.util.spec_from_file_location("multi_gpu_parity", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _launch(nproc: int, device: str, out: Path, *extra: str, timeout: float = 120) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **NO_MULTICAST}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(SCRIPT), "--device", device, "--out", str(out), *extra,
    ]  # fmt: skip
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return proc.stdout


def test_layouts_are_read_and_checked() -> None:
    parity = _parity_module()
    assert parity.parse_layout("tp2", 8) == parity.Layout(dp=4, cp=1, tp=2, sp=False)
    assert parity.parse_layout("sp-cp2-tp2-dp2", 8) == parity.Layout(2, 2, 2, True)
    assert parity.parse_layout("dp2-cp2-tp2-sp", 8).name == "dp2-cp2-tp2-sp"
    for bad, message in (
        ("tp3", "does not divide the world 8"),
        ("dp2-tp2", "is not the world 8"),
        ("sp", "sequence parallel needs tp > 1"),
        ("pp2", "cannot read 'pp2'"),
    ):
        with pytest.raises(ValueError, match=message):
            parity.parse_layout(bad, 8)
    assert parity.auto_layouts(2) == ["tp2", "tp2-sp", "cp2", "dp2"]
    assert "dp2-cp2-tp2-sp" in parity.auto_layouts(8)
    assert [parity.parse_layout(n, 8).name for n in parity.auto_layouts(8)][-1] == "dp1-cp8-tp1"


def test_parity_launcher_rehearsal_on_gloo(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    stdout = _launch(4, "cpu", out, "--layouts", LAYOUTS, "--checks", CHECKS)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ran = {(r["layout"], r["check"]) for r in rows}
    assert all(r["result"] == "PASS" for r in rows), [r for r in rows if r["result"] != "PASS"]
    # Each dimension was exercised: TP+SP layers, CP attention (both algorithms), the block
    # at every layout, DP accumulation and ZeRO-1, and the largest (cp×tp+SP) combination.
    for expected in (
        ("dp2-cp1-tp2-sp", "tp_layers_sp"),
        ("dp2-cp1-tp2-sp", "recompute_full"),
        ("dp2-cp1-tp2-sp", "moe_sp"),
        ("dp2-cp2-tp1", "ring_attention"),
        ("dp2-cp2-tp1", "decoder_block_ring"),
        ("dp4-cp1-tp1", "dp_accumulation"),
        ("dp4-cp1-tp1", "zero1"),
        ("dp1-cp2-tp2-sp", "decoder_block"),
        ("dp1-cp2-tp2-sp", "decoder_block_fsdp"),
    ):
        assert expected in ran, expected
    assert "| layout | check | result |" in stdout and ": PASS" in stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs")
def test_parity_launcher_on_gpus(tmp_path: Path) -> None:
    nproc = min(torch.cuda.device_count(), 8)
    out = tmp_path / "rows.jsonl"
    _launch(nproc, "cuda", out, "--layouts", "auto", timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["result"] == "PASS" for r in rows), [
        r for r in rows if r["result"] != "PASS"
    ]
