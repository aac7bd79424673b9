"""``mt-plan`` end to end: the table and launch line, ``explain``, and one-line bad-input errors."""

from __future__ import annotations

import json

import pytest

from mt_plan.calibration import load_table
from mt_plan.cli import layout_of, main
from mt_plan.cluster import ClusterError, cluster_from_dict, load_cluster
from mt_plan.models import resolve

SMALL = [
    "model=llama3_8b",
    "model.n_layers=4",
    "trainer.seq_len=4096",
    "trainer.global_batch_size=8",
]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_prints_a_ranked_table_and_a_launch_line(capsys, tmp_path) -> None:
    path = tmp_path / "plan.jsonl"
    code, out, err = run(capsys, "search", *SMALL, "--gpus", "4", "--pp", "1", "--fp8", "none",
                         "--top", "3", "--json", str(path))  # fmt: skip
    assert code == 0, err
    assert "| 1 |" in out and "| 3 |" in out and "| 4 |" not in out
    launch = out.strip().splitlines()[-1]
    assert launch.startswith("torchrun --standalone --nproc-per-node 4 -m mt_train model=llama3_8b")
    assert "trainer.global_batch_size=8" in launch and "parallel.tp=" in launch
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    speeds = [r["tokens_per_s_per_gpu"] for r in rows]
    assert speeds == sorted(speeds, reverse=True) and all(r["fits"] for r in rows)


def test_search_explains_a_row_of_its_table(capsys) -> None:
    code, out, err = run(capsys, "search", *SMALL, "--gpus", "2", "--pp", "1", "--fp8", "none",
                         "--explain", "2")  # fmt: skip
    assert code == 0, err
    second_row = next(line for line in out.splitlines() if line.startswith("| 2 |"))
    assert f"layout: {second_row.split('|')[2].strip()}" in out
    assert "memory of the fullest rank" in out
    code, _, err = run(capsys, "search", *SMALL, "--gpus", "2", "--pp", "1", "--fp8", "none",
                       "--explain", "100000")  # fmt: skip
    assert code == 2 and "--explain=100000: the table has rows 1 to" in err


def test_explain_breaks_one_layout_down(capsys) -> None:
    code, out, err = run(capsys, "explain", *SMALL, "trainer.micro_batch_size=2",
                         "parallel.tp=2", "parallel.sequence_parallel=true", "--gpus", "4")  # fmt: skip
    assert code == 0, err
    assert "layout: tp2+sp cp1 dp2 ddp mb2 none none" in out
    assert "attention_core" in out and "tp " in out and "gradients" in out


def test_explain_prices_recompute_every(capsys) -> None:
    full = ["parallel.recompute=full", "trainer.micro_batch_size=2"]
    code, out, err = run(capsys, "explain", *SMALL, *full, "parallel.recompute_every=2",
                         "--gpus", "1")  # fmt: skip
    assert code == 0, err
    assert "layout: tp1 cp1 dp1 ddp mb2 full/every2 none" in out
    assert "recompute" in out and "fits" in out
    # the layout's overrides give the trainer the same run back
    train = resolve([*SMALL, *full, "parallel.recompute_every=2"])
    layout = layout_of(train, 1)
    assert layout.recompute_every == 2
    assert "parallel.recompute_every=2" in layout.overrides(8)
    assert layout_of(resolve(["model=llama3_8b", "model.n_layers=4", "trainer.seq_len=4096",
                              *layout.overrides(8)]), 1) == layout  # fmt: skip
    code, out, err = run(capsys, "explain", *SMALL, *full, "parallel.recompute_every=0",
                         "--gpus", "1")  # fmt: skip
    assert code == 2 and out == ""
    assert "parallel.recompute_every=0 must be a positive integer" in err


def test_explain_prices_an_explicit_pipeline_split(capsys) -> None:
    split = ["trainer.micro_batch_size=1", "parallel.pp=2", "parallel.pp_layers=[3,1]"]
    code, out, err = run(capsys, "explain", *SMALL, *split, "--gpus", "2")
    assert code == 0, err
    assert "layout: tp1 cp1 dp1 pp2/1f1b/layers3,1 ddp mb1 none none" in out
    layout = layout_of(resolve([*SMALL, *split]), 2)
    assert layout.pp_layers == (3, 1) and "parallel.pp_layers=[3,1]" in layout.overrides(8)
    assert layout_of(resolve(["model=llama3_8b", "model.n_layers=4", "trainer.seq_len=4096",
                              *layout.overrides(8)]), 2) == layout  # fmt: skip
    # the trainer's own refusal, naming the value and what is valid
    code, out, err = run(capsys, "explain", *SMALL, "parallel.pp=2", "parallel.pp_layers=[3,2]",
                         "--gpus", "2")  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "parallel.pp_layers=[3, 2] sums to 5, the model has 4 layers" in err


def test_search_picks_and_prints_recompute_every(capsys) -> None:
    code, out, err = run(capsys, "search", *SMALL, "--gpus", "1", "--fp8", "none",
                         "--recompute", "full", "--recompute-every", "1,2")  # fmt: skip
    assert code == 0, err
    first = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    assert "full/every2" in first  # half the blocks recomputed: faster, and it fits
    assert out.strip().splitlines()[-1].endswith("parallel.recompute_every=2")
    code, _, err = run(capsys, "search", *SMALL, "--recompute-every", "0,2")
    assert code == 2 and "--recompute-every [0, 2]: positive integers" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--gpus", "0"], "--gpus=0 must be a positive integer"),
        (["--gpus", "12"], "--gpus=12 is not a multiple of gpus_per_node=8 (whole nodes: 8 or 16)"),
        (
            ["--cluster", "tpu_pod"],
            "unknown cluster 'tpu_pod'; shipped: h100_nodes, h200, h200_nodes",
        ),
        (["--calibration", "b200"], "unknown calibration table 'b200'; shipped: h100, h200"),
        (["--nodes", "0"], "nodes=0 must be a positive integer"),
        (["model=gpt5"], "gpt5"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, message) -> None:
    code, out, err = run(capsys, "search", *SMALL, *argv)
    assert code == 2 and out == ""
    assert err.startswith("mt-plan: error: ") and err.count("\n") == 1
    assert message in err


def test_a_model_that_fits_nowhere_names_the_gpus_it_needs(capsys) -> None:
    code, _, err = run(capsys, "search", "model=llama3_70b", "trainer.seq_len=4096",
                       "trainer.global_batch_size=64", "--gpus", "1")  # fmt: skip
    assert code == 2
    assert "model=llama3_70b fits no layout on 1 GPUs" in err
    assert "the smallest GPU count that fits is 16" in err


def test_cluster_validation_names_the_value() -> None:
    data = json.loads(json.dumps(load_cluster("h200_nodes").to_dict()))
    data["gpus_per_node"] = 0
    with pytest.raises(ClusterError, match="gpus_per_node=0 must be a positive integer"):
        cluster_from_dict(data)
    data["gpus_per_node"] = 8
    data["intra_node"]["bandwidth"] = 0
    with pytest.raises(ClusterError, match="intra_node needs bandwidth > 0"):
        cluster_from_dict(data)
    del data["gpu"]
    with pytest.raises(ClusterError, match="missing key 'gpu'"):
        cluster_from_dict(data)


def test_calibrate_writes_a_table_the_search_uses(capsys, tmp_path) -> None:
    path = tmp_path / "cpu.json"
    code, _, err = run(capsys, "calibrate", "--tiny", "--device", "cpu", "--out", str(path))
    assert code == 0, err
    table = load_table(str(path))
    kinds = {(e.op, e.dtype) for e in table.entries}
    for kind in [("gemm_fwd", "bf16"), ("gemm_dgrad", "bf16"), ("gemm_wgrad", "bf16"),
                 ("gemm_wgrad", "fp8_tensorwise"), ("attention_fwd", "bf16"),
                 ("attention_bwd", "bf16"), ("rmsnorm", "bf16"), ("adamw", "fp32"),
                 ("grouped_linear_fwd", "bf16"), ("grouped_linear_bwd", "bf16"),
                 ("grouped_linear_fwd", "fp8_tensorwise"),
                 ("grouped_linear_bwd", "fp8_tensorwise"), ("kernel_launch", "none"),
                 ("host_read", "none")]:  # fmt: skip
        assert kind in kinds
    assert all(e.rate > 0 for e in table.entries)
    # the cost model finds the expert entries it wrote
    moe = ["model=mixtral_tiny", "model.vocab_size=320", "fp8=tensorwise", "--cluster", "h200"]
    code, out, err = run(capsys, "explain", *moe, "--calibration", str(path))
    assert code == 0, err
    assert "(fp8_tensorwise): priced from the table's grouped_linear entries (measured" in out
    # a CPU-calibrated search is priced from measurements: far slower than the H200 seed table
    h200 = run(
        capsys, "search", *SMALL, "--gpus", "1", "--fp8", "none", "--json", str(tmp_path / "a")
    )
    cpu = run(capsys, "search", *SMALL, "--gpus", "1", "--fp8", "none", "--calibration", str(path),
              "--json", str(tmp_path / "b"))  # fmt: skip
    assert h200[0] == cpu[0] == 0
    fast = json.loads((tmp_path / "a").read_text().splitlines()[0])["tokens_per_s_per_gpu"]
    slow = json.loads((tmp_path / "b").read_text().splitlines()[0])["tokens_per_s_per_gpu"]
    assert slow < fast / 100
    # without --fp8 the search tries the recipes whose GEMM passes the table measured
    code, _, err = run(capsys, "search", *SMALL, "--gpus", "1", "--calibration", str(path),
                       "--json", str(tmp_path / "c"))  # fmt: skip
    assert code == 0, err
    lines = (tmp_path / "c").read_text().splitlines()
    assert {json.loads(line)["layout"]["fp8"] for line in lines} == {"none", "tensorwise"}


@pytest.mark.gpu
def test_calibrate_on_the_gpu(capsys, tmp_path) -> None:
    """The full table on a CUDA GPU: every op kind measured, no rate above the datasheet peak."""
    import torch

    path = tmp_path / "gpu.json"
    code, _, err = run(capsys, "calibrate", "--device", "cuda", "--out", str(path))
    assert code == 0, err
    table = load_table(str(path))
    kinds = {(e.op, e.dtype) for e in table.entries}
    assert {("gemm_fwd", "bf16"), ("gemm_wgrad", "fp8_tensorwise"), ("attention_bwd", "bf16"),
            ("grouped_gemm_wgrad", "bf16"),
            ("cross_entropy", "bf16"), ("adamw", "fp32"), ("grouped_linear_bwd", "bf16"),
            ("grouped_linear_bwd", "fp8_rowwise"),
            ("grouped_linear_bwd", "fp8_blockwise")} <= kinds  # fmt: skip
    assert table.device == torch.cuda.get_device_name()
    bf16 = max(e.rate for e in table.entries if (e.op, e.dtype) == ("gemm_fwd", "bf16"))
    assert 1e14 < bf16 < 2.5e15  # a Hopper-class GPU: hundreds of dense bf16 TFLOP/s


@pytest.mark.parametrize("rows,groups", [(256, 4), (8192, 8), (8192, 64), (32768, 32)])
def test_calibrated_expert_groups_are_uneven_and_unaligned(rows, groups) -> None:
    """The expert linears are timed on routed-like groups: summing to the rows, none a multiple
    of the grouped FP8 wgrad's 16-token alignment (so its padding is inside the time)."""
    from mt_plan.measure import routed_sizes

    sizes = routed_sizes(rows, groups)
    assert len(sizes) == groups and sum(sizes) == rows
    assert all(size > 0 and size % 16 for size in sizes)
    assert len(set(sizes)) > 1
