"""The MoE benchmark scripts run end to end on the CPU with tiny shapes (``--smoke``) and write
the rows their documentation promises."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import grouped_gemm
import moe_throughput
import pytest


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_grouped_gemm_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    grouped_gemm.main(["--smoke", "--out", str(out)])
    rows = _rows(out)
    assert [r["routing"] for r in rows] == list(grouped_gemm.ROUTINGS)
    for row in rows:
        assert sum(row["sizes"]) == row["rows"]
        for column in grouped_gemm.COLUMNS:
            assert row[f"{column}_ms"] > 0 and row[f"{column}_tflops"] > 0


def test_skewed_routing_is_skewed_and_complete() -> None:
    sizes = grouped_gemm.group_sizes(16, 64, "skewed")
    assert sum(sizes) == 16 * 64 and max(sizes) > 2 * 64


def test_moe_throughput_smoke_layers_with_the_recipes_expert_formats(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    moe_throughput.main(
        ["--smoke", "--skip-models", "--expert-formats", "recipe", "--profile", "--out", str(out),
         "--stacks", "mt_bf16,mt_bf16_compiled,mt_fp8"]
    )  # fmt: skip
    rows = _rows(out)
    assert rows and all(r["kind"] == "layer" and r["expert_formats"] == "recipe" for r in rows)
    assert {r["stack"] for r in rows} == {"mt_bf16", "mt_bf16_compiled", "mt_fp8"}  # --stacks
    # --profile: every layer row carries its profiled steps (no kernels on a CPU, a wall time)
    assert all(r["profile"]["steps"] == 2 and r["profile"]["wall_ms"] > 0 for r in rows)


def test_profile_sources_trace_time_to_the_lines_of_mt(tmp_path: Path) -> None:
    # --profile-sources: the FP8 layer's self time per operator and call site, each with the
    # innermost frames of the repository (the FP8 GEMMs are traced to mt_fp8's GEMM code).
    out = tmp_path / "rows.jsonl"
    moe_throughput.main(
        ["--smoke", "--skip-models", "--profile", "--profile-sources", "--out", str(out),
         "--stacks", "mt_fp8"]
    )  # fmt: skip
    for row in _rows(out):
        sources = row["profile"]["top_sources_ms"]
        assert sources and all(ms > 0 and frames for ms, _, _, frames in sources)
        assert any(f.startswith("mt_fp8/gemm.py") for *_, fs in sources for f in fs), sources


def test_moe_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    moe_throughput.main(["--smoke", "--out", str(out)])
    rows = _rows(out)
    layer_rows = [r for r in rows if r["kind"] == "layer"]
    assert {(r["stack"], r["routing"]) for r in layer_rows} >= {
        ("reference", "natural"), ("mt_bf16", "natural"), ("mt_bf16", "balanced"),
        ("mt_fp8", "balanced"),
    }  # fmt: skip
    model_rows = [r for r in rows if r["kind"] == "model"]
    assert {r["stack"] for r in model_rows} == {"mt_bf16", "mt_fp8"}
    assert {r["model"] for r in model_rows} == {"mixtral_tiny", "deepseek_v3_tiny"}
    for row in rows:
        assert row["tokens_per_s"] > 0
    balanced = next(r for r in layer_rows if r["routing"] == "balanced" and r["stack"] == "mt_bf16")
    assert balanced["max_vio"] == 0.0  # forced balance really is balanced


def test_reference_moe_computes_what_the_mt_layer_computes() -> None:
    # fp32 on the CPU, the same weights: only summation order differs (dot products of length
    # <= 32, u = 6e-8), far below 1e-5 relative; a wrong expert, weight or token is O(1).
    import torch

    from mt_parallel.moe import MoE, MoEConfig

    torch.manual_seed(0)
    for cfg in (
        MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32, balancing="none"),
        MoEConfig(num_experts=8, top_k=3, expert_ffn_dim=16, n_shared_experts=2, balancing="none"),
    ):  # the benchmark's layers balance with "none"; forced_balance refuses a balancing loss
        layer = MoE(32, cfg)
        x = torch.randn(1, 40, 32)
        reference = moe_throughput.ReferenceMoE(layer)
        expected = layer(x)
        assert torch.allclose(
            reference(x), expected, rtol=0, atol=1e-5 * float(expected.abs().max())
        )
        reference.balanced = True
        with moe_throughput.forced_balance(True):
            balanced = layer(x)
        assert torch.allclose(
            reference(x), balanced, rtol=0, atol=1e-5 * float(balanced.abs().max())
        )
        assert (balanced - expected).abs().max() > 1e-3  # forcing changed the routing
        with moe_throughput.forced_balance(True), pytest.raises(ValueError, match="aux_loss"):
            MoE(32, dataclasses.replace(cfg, balancing="aux_loss"))(x)


def test_moe_alltoall_rehearsal_on_gloo(tmp_path: Path) -> None:
    # The multi-GPU dispatch benchmark under torchrun on 2 gloo processes: it checks that
    # dispatch + combine around identity experts returns every token (else it exits non-zero)
    # and writes one row per routing.
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "multi_gpu" / "moe_alltoall.py"
    out = tmp_path / "rows.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(script), "--device", "cpu", "--tiny", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = _rows(out)
    assert [r["routing"] for r in rows] == ["uniform", "skewed"]
    assert all(r["busbw_fraction"] > 0 and r["world"] == 2 for r in rows)


def test_moe_balancing_smoke_and_verdicts(tmp_path: Path) -> None:
    import moe_balancing

    data = tmp_path / "data"
    from mt_train.data.prepare import prepare_bundled

    prepare_bundled(data)
    moe_balancing.main(
        ["--smoke", "--out", str(tmp_path / "runs"), "--overrides", f"data.path={data}"]
    )
    results = json.loads((tmp_path / "runs" / "moe_balancing.json").read_text())
    assert set(results["runs"]) == set(moe_balancing.MODES)
    for run in results["runs"].values():
        assert run["steps"] == [1, 2, 3, 4] and len(run["max_vio_global"]) == 4
        assert run["val"] and run["final_val_loss"] > 0
    verdict = results["verdicts"]
    assert {"aux_free_balanced", "none_visibly_worse", "aux_free_loss_within_1pct"} <= set(verdict)


def test_balancing_verdicts_by_hand() -> None:
    import moe_balancing

    def run(vio_global: list[float], vio: list[float], val: float) -> dict:
        steps = list(range(1, len(vio) + 1))
        return {"steps": steps, "max_vio_global": vio_global, "max_vio": vio,
                "final_val_loss": val}  # fmt: skip

    runs = {
        "aux_free": run([0.5, 0.04, 0.03, 0.02], [0.5, 0.1, 0.15, 0.1], 2.00),
        "aux_loss": run([0.5, 0.2, 0.2, 0.2], [0.5, 0.3, 0.3, 0.3], 1.99),
        "none": run([2.0, 1.0, 1.0, 1.0], [2.0, 1.5, 1.5, 1.5], 2.05),
    }
    verdict = moe_balancing.verdicts(runs, settle=1)
    assert verdict["aux_free_global_median"] == 0.03 and verdict["aux_free_balanced"]
    assert verdict["none_visibly_worse"]
    assert verdict["aux_free_loss_within_1pct"]  # 2.00 / 1.99 - 1 = 0.5%
    runs["aux_free"] = run([0.5, 0.3, 0.3, 0.3], [0.5, 0.3, 0.3, 0.3], 2.05)
    verdict = moe_balancing.verdicts(runs, settle=1)
    assert not verdict["aux_free_balanced"] and not verdict["aux_free_loss_within_1pct"]
