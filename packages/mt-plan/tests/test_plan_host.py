"""The host-time floor of the cost model: hand-computed seconds on toy layers, the floor on
real layouts, the calibration's host entries, ``explain``'s host line, and the launch counts
and host reads recorded in ``mt_plan.cost`` against mt's runtime (``plan_launch_counts.py``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mt_plan import cost as cost_module
from mt_plan.calibration import (
    DEFAULT_HOST_SECONDS,
    CalibrationTable,
    Entry,
    load_table,
    table_from_dict,
)
from mt_plan.cli import layout_of, main
from mt_plan.cluster import load_cluster
from mt_plan.cost import (
    END_LAUNCHES,
    EXPERT_MLP_HOST_READS,
    EXPERT_PATH,
    KERNEL_LAUNCHES,
    CostModel,
    Workload,
    _floored_passes,
    _floored_step,
    _Piece,
    expert_path,
)
from mt_plan.models import resolve, shape_of

COUNTS_SCRIPT = Path(__file__).with_name("plan_launch_counts.py")


def piece(forward, igrad, wgrad, host_f, host_b, reads_f=0, reads_b=0) -> _Piece:
    return _Piece(forward, igrad, wgrad, host_f, host_b, reads_f, reads_b, 0.0, 0.0)


# One toy layer (forward 3 s, backward 1 + 1 s on the device) and the ends (1 s each way), two
# micro-batches, then 0.5 s of reduction and optimizer. Device per micro-batch: 3 + 1 + 1 + 2 = 7.
ENDS = piece(1.0, 1.0, 0.0, 0.5, 0.5)


def test_without_reads_the_step_is_the_larger_of_device_and_host() -> None:
    light = [piece(3.0, 1.0, 1.0, 1.0, 1.0), ENDS]  # host 3 s a micro-batch
    assert _floored_step(light, 2, 0.5, 0.25) == 2 * 7 + 0.5  # not bound: 14.5 s
    heavy = [piece(3.0, 1.0, 1.0, 5.0, 5.0), ENDS]  # host 11 s a micro-batch
    assert _floored_step(heavy, 2, 0.5, 0.25) == 2 * 11  # bound: the host runs ahead, 22 s


def test_a_read_cuts_the_step_into_segments() -> None:
    # one read at the layer's forward (0.25 s): each micro-batch's work after it is a segment
    # that ends at the next micro-batch's read (or the step's end, after the optimizer)
    light = [piece(3.0, 1.0, 1.0, 1.0, 1.0, reads_f=1), ENDS]
    assert _floored_step(light, 2, 0.5, 0.25) == 7 + 7.5  # device-bound segments: 14.5 s
    heavy = [piece(3.0, 1.0, 1.0, 5.0, 5.0, reads_f=1), ENDS]
    assert _floored_step(heavy, 2, 0.5, 0.25) == 11.25 + 11.25  # host-bound: 22.5 s
    # a host-heavy layer before a device-heavy one: without reads the host runs ahead (5 s);
    # with a read at each layer the device waits through the first (4 s) and the host through
    # the second's (4 s on the device): 8 s
    a, b = piece(1.0, 0.0, 0.0, 4.0, 0.0), piece(4.0, 0.0, 0.0, 1.0, 0.0)
    ends = piece(0.0, 0.0, 0.0, 0.0, 0.0)
    assert _floored_step([a, b, ends], 1, 0.0, 0.0) == 5.0
    read_a, read_b = (dataclasses.replace(p, reads_f=1) for p in (a, b))
    assert _floored_step([read_a, read_b, ends], 1, 0.0, 0.0) == 8.0


def test_pipeline_passes_are_floored_alone() -> None:
    # F: 3 + 1 s device, 5 + 0.5 host: +1.5 s; the backward's host split as its device time
    # is: I (1 + 1 s device) gets half the layer's 5 s and all the ends' 0.5 (their W is 0):
    # 3 s, +1; W (1 s) the other 2.5 s, +1.5
    layer = piece(3.0, 1.0, 1.0, 5.0, 5.0)
    assert _floored_passes([layer, ENDS], 0.25) == (1.5, 1.0, 1.5)
    read = dataclasses.replace(layer, reads_f=1)  # 0.25 s more host in F's segment after it
    assert _floored_passes([read, ENDS], 0.25) == (1.75, 1.0, 1.5)
    light = piece(3.0, 1.0, 1.0, 1.0, 1.0, reads_f=1)
    assert _floored_passes([light, ENDS], 0.25) == (0.0, 0.0, 0.0)


def _cost(overrides: list[str], table: CalibrationTable) -> tuple[CostModel, object]:
    train = resolve(overrides)
    work = Workload(seq_len=train.trainer.seq_len, global_batch=train.trainer.global_batch_size)
    model = CostModel(shape_of(train.model), load_cluster("h100_nodes"), table, work)
    return model, layout_of(train, 1)


def _with_host(table: CalibrationTable, launch_s: float, read_s: float) -> CalibrationTable:
    host = [Entry("kernel_launch", "none", (1000,), 1 / launch_s),
            Entry("host_read", "none", (200,), 1 / read_s)]  # fmt: skip
    return CalibrationTable(table.device, [*table.entries, *host], table.source)


LLAMA = ["model=llama3_8b", "model.n_layers=2", "model.vocab_size=320", "trainer.seq_len=4096",
         "trainer.micro_batch_size=1", "trainer.global_batch_size=2"]  # fmt: skip
MIXTRAL_FP8 = ["model=mixtral_8x7b", "model.n_layers=2", "model.vocab_size=320",
               "trainer.seq_len=4096", "trainer.micro_batch_size=1",
               "trainer.global_batch_size=1", "fp8=tensorwise"]  # fmt: skip


@pytest.mark.parametrize(
    "overrides", [LLAMA, MIXTRAL_FP8], ids=["llama_bf16", "mixtral_tensorwise"]
)
def test_the_floor_on_real_layouts(overrides) -> None:
    h100 = load_table("h100")
    device_only = _cost(overrides, _with_host(h100, 1e-15, 1e-15))
    device = device_only[0].estimate(device_only[1])
    assert device.host_floor == 0.0
    # negligible host costs (a microsecond per launch and read) leave the step the device's
    model, layout = _cost(overrides, _with_host(h100, 1e-6, 1e-6))
    est = model.estimate(layout)
    assert est.step_time == device.step_time and est.host_floor == 0.0
    # a second per launch and per read: every segment is host-bound, so the step is exactly
    # the host's time, launches and reads counted per micro-batch and layer (rel 1e-12 and
    # 1e-9: the same float64 seconds summed in another order, the device's step beside them)
    model, layout = _cost(overrides, _with_host(h100, 1.0, 1.0))
    est = model.estimate(layout)
    assert est.step_time == pytest.approx(est.host_time, rel=1e-12)
    assert est.host_time == pytest.approx(est.kernel_launches + est.host_reads, rel=1e-12)
    assert est.host_floor == pytest.approx(est.step_time - device.step_time, rel=1e-9)
    m, layers = est.microbatches, model.model.n_layers
    moe = model.model.moe
    recipe = layout.fp8
    key = ("moe" if moe else "llama") + f"/{recipe}"
    counts = KERNEL_LAUNCHES[key]
    experts = model.model.num_experts if moe else 0
    per_layer = (counts.forward + counts.backward
                 + (counts.expert_forward + counts.expert_backward) * experts)  # fmt: skip
    assert est.kernel_launches == m * (layers * per_layer + sum(END_LAUNCHES[key]))
    reads = EXPERT_MLP_HOST_READS[(recipe, expert_path(recipe, experts))] if moe else 0
    assert est.host_reads == m * layers * reads
    assert est.host_reads == (2 if moe else 0)  # tensorwise experts: one read per layer


def test_full_recompute_repeats_the_forward_launches_and_reads() -> None:
    table = _with_host(load_table("h100"), 1.0, 1.0)
    plain = _cost(MIXTRAL_FP8, table)
    full = _cost([*MIXTRAL_FP8, "parallel.recompute=full"], table)
    a, b = plain[0].estimate(plain[1]), full[0].estimate(full[1])
    counts = KERNEL_LAUNCHES["moe/tensorwise"]
    forward = counts.forward + counts.expert_forward * 8
    assert b.kernel_launches - a.kernel_launches == 2 * forward  # two layers, one micro-batch
    assert b.host_reads == 2 * a.host_reads


def test_host_entries_are_read_and_written(tmp_path) -> None:
    table = _with_host(CalibrationTable("test"), 4e-6, 25e-6)
    assert table.host_seconds("kernel_launch") == (pytest.approx(4e-6), "measured")
    assert table.host_seconds("host_read") == (pytest.approx(25e-6), "measured")
    data = table.to_dict()
    assert {"op": "kernel_launch", "dtype": "none", "shape": [1000], "per_s": 1 / 4e-6} in data[
        "entries"
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    assert load_table(str(path)).host_seconds("kernel_launch")[0] == pytest.approx(4e-6)
    empty = CalibrationTable("none")
    assert empty.host_seconds("kernel_launch") == (DEFAULT_HOST_SECONDS["kernel_launch"], "default")
    assert load_table("h100").host_seconds("host_read")[1] == "default"
    with pytest.raises(ValueError, match="host op 'launch'; valid: kernel_launch, host_read"):
        empty.host_seconds("launch")
    with pytest.raises(ValueError, match=r"calibration entry 0 .* is malformed"):
        table_from_dict({"entries": [{"op": "kernel_launch", "dtype": "none", "shape": [1],
                                      "flops_per_s": 1.0}]})  # fmt: skip


def test_calibrate_measures_the_host_entries() -> None:
    import torch

    from mt_plan.measure import _host

    entries = {e.op: e for e in _host(torch.device("cpu"), tiny=True)}
    assert set(entries) == {"kernel_launch", "host_read"}
    # a CPU op or tolist takes between a tenth of a microsecond and a millisecond of the host
    assert all(1e3 < e.rate < 1e7 for e in entries.values())


def _explain(capsys, overrides: list[str], table: CalibrationTable, tmp_path) -> str:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table.to_dict()))
    argv = ["explain", *overrides, "--calibration", str(path), "--cluster", "h100_nodes"]
    code = main([*argv, "--gpus", "1"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return next(line for line in out.out.splitlines() if line.startswith("host per step"))


def test_explain_shows_the_host_time_and_whether_the_floor_binds(capsys, tmp_path) -> None:
    h100 = load_table("h100")
    line = _explain(capsys, MIXTRAL_FP8, h100, tmp_path)
    launches = KERNEL_LAUNCHES["moe/tensorwise"]
    count = 2 * (launches.forward + launches.backward)
    count += 2 * 8 * (launches.expert_forward + launches.expert_backward)
    count += sum(END_LAUNCHES["moe/tensorwise"])
    assert f"({count:,.0f} kernel launches at 10.0 us, 2 device-to-host reads at 30.0 us" in line
    assert line.endswith("default host costs); the device bounds the step")
    line = _explain(capsys, MIXTRAL_FP8, _with_host(h100, 1e-3, 1e-3), tmp_path)
    assert "at 1000.0 us, 2 device-to-host reads at 1000.0 us; measured host costs)" in line
    assert "; the floor binds: +" in line


def _runtime_counts(keys: list[str]) -> dict:
    pytest.importorskip(
        "triton", reason="the counts run mt-fp8's Triton kernels in the interpreter"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(COUNTS_SCRIPT), *keys], capture_output=True,
                          text=True, env=env, timeout=900, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


DEFAULT_TIER_COUNTS = ("llama/none", "llama/tensorwise", "moe/tensorwise", "mla/none")
"""Counted in the default tier (under two minutes each on a CPU core); the other keys, whose
Triton kernels take minutes in the interpreter, in the full tier."""


@pytest.mark.parametrize(
    "key",
    [key if key in DEFAULT_TIER_COUNTS else pytest.param(key, marks=pytest.mark.slow)
     for key in sorted(KERNEL_LAUNCHES)],
)  # fmt: skip
def test_recorded_launch_counts_are_the_runtimes(key) -> None:
    """KERNEL_LAUNCHES, END_LAUNCHES and the expert reads equal what mt's runtime launches and
    reads today (cost module docstring, "Launch counts"): a change to the runtime's kernels
    fails here until the table is counted again."""
    measured = _runtime_counts([key])[key]
    counts = KERNEL_LAUNCHES[key]
    assert (measured["forward"], measured["backward"]) == (counts.forward, counts.backward)
    assert (measured["expert_forward"], measured["expert_backward"]) == (
        counts.expert_forward, counts.expert_backward,
    )  # fmt: skip
    if "ends_forward" in measured:
        assert (measured["ends_forward"], measured["ends_backward"]) == END_LAUNCHES[key]
    family, recipe = key.split("/")
    experts = 8  # the counted models' first expert count (plan_launch_counts.EXPERTS)
    reads = EXPERT_MLP_HOST_READS[(recipe, expert_path(recipe, experts))] if "moe" in family else 0
    assert measured["host_reads"] == reads


def test_every_recipe_and_layer_kind_has_counts() -> None:
    kinds = ("llama", "moe", "mla", "mla_moe")
    for recipe in EXPERT_PATH:
        counted = cost_module.LAUNCH_RECIPE_STANDIN.get(recipe, recipe)
        assert all(f"{kind}/{counted}" in KERNEL_LAUNCHES for kind in kinds)
        assert all(f"{kind}/{counted}" in END_LAUNCHES for kind in ("llama", "moe", "mla_moe"))


def test_the_block_path_threshold_is_mt_fp8s() -> None:
    import mt_fp8.grouped

    assert cost_module.BLOCK_GROUPED_MIN_EXPERTS == mt_fp8.grouped.BLOCK_GROUPED_MIN_EXPERTS
    assert expert_path("blockwise", 8) == "per_expert"
    assert expert_path("mxfp8", 32) == "grouped_block"
    assert EXPERT_MLP_HOST_READS[("blockwise", expert_path("blockwise", 32))] == 0
