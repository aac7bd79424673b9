"""Two gloo ranks: every layout (dp=2 under DDP, FSDP2 and ZeRO-1, tp=2 with sequence parallel,
cp=2 with all-gather or ring attention) matches one process, greedy samples included; sharded
checkpoints resume bit for bit (dropout on) and load at other layouts; in-memory snapshots
restore sharded state. A pool shared across modules; the single-process references run in this
process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_checks
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.hf_checkpoints import load_model

# fp32 on CPU; the layouts differ only in summation order (gradient all-reduce / reduce-scatter,
# TP partial sums, CP's split softmax), which moves each loss by a few ulps per step; 8 AdamW
# steps keep that far below 1e-4.
RTOL = 1e-4
SAMPLE = {"trainer.sample_tokens": 12}
# Resume checks: a constant schedule after warmup, so stopping at step 8 does not change the LR.
CONSTANT = {"scheduler": "constant"}


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.fixture(scope="module")
def reference(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return train_checks.run_summary(
        tiny_overrides(kjv_data, **SAMPLE), tmp_path_factory.mktemp("single")
    )


@pytest.fixture(scope="module")
def uninterrupted(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    """12 steps in one process: the curve resumed runs continue, and its checkpoints' folder
    (steps 4, 8 and 12; the step-8 one equals that of a run stopped at step 8)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    overrides = tiny_overrides(kjv_data, **CONSTANT, **{"trainer.max_steps": 12})
    return train_checks.run_losses(overrides, out), out / "checkpoints"


LAYOUTS = {
    "dp2": {},
    "tp2_sp": {"parallel": "tp2"},
    "cp2": {"parallel": "cp2"},
    "fsdp_dp2": {"parallel": "fsdp"},
    "zero1_dp2": {"parallel": "zero1"},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(
    layout: str, pool, kjv_data: Path, reference: dict, tmp_path: Path
) -> None:
    overrides = tiny_overrides(kjv_data, **LAYOUTS[layout], **SAMPLE)
    per_rank = pool.run(train_checks.run_summary, overrides, tmp_path)
    assert per_rank[0] == per_rank[1]  # every rank reports the global mean loss, same sample
    assert per_rank[0]["losses"] == pytest.approx(reference["losses"], rel=RTOL)
    # Greedy decoding at every layout (all ranks run the forward): the same text. The logits
    # agree to ~1e-6, far below the gap between the best two tokens of these 12 steps.
    assert per_rank[0]["sample"] == reference["sample"]
    assert len(reference["sample"]) > len("And God said")
    assert (tmp_path / "checkpoints" / "step-00000008" / "rank-00001.safetensors").is_file()


def test_cp2_ring_with_document_masking_matches_single_process(
    pool, kjv_data: Path, reference: dict, tmp_path: Path
) -> None:
    masked = {"data.document_masking": True}
    single = train_checks.run_losses(tiny_overrides(kjv_data, **masked), tmp_path / "single")
    # Some windows cross a chapter end, so the mask changes the curve, by ~1e-4 relative here
    # (layouts differ by ~1e-7).
    change = max(abs(a - b) / b for a, b in zip(single, reference["losses"], strict=True))
    assert change > 1e-5
    overrides = tiny_overrides(
        kjv_data, parallel="cp2", **masked, **{"parallel.cp_attention": "ring"}
    )
    per_rank = pool.run(train_checks.run_losses, overrides, tmp_path / "cp2")
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(single, rel=RTOL)


@pytest.mark.parametrize("parallel", ["zero1", "fsdp"])
def test_sharded_run_with_dropout_resumes_exactly(
    parallel: str, pool, kjv_data: Path, tmp_path: Path
) -> None:
    # Dropout draws from torch's generators and mt_parallel's tracker (attention dropout);
    # the checkpoint holds both, and each rank's pieces of the sharded optimizer state. The
    # run's own step-8 checkpoint is resumed: under the constant schedule a run stopped at
    # step 8 would have written the same one.
    common = {"parallel": parallel, "model.dropout": 0.1, **CONSTANT, "trainer.max_steps": 12}
    full = pool.run(train_checks.run_losses, tiny_overrides(kjv_data, **common), tmp_path / "full")[
        0
    ]
    step = tmp_path / "full" / "checkpoints" / "step-00000008"
    manifest = (step / "manifest.json").read_text()
    assert "rng/rank1/tracker/tensor-parallel/cpu" in manifest
    assert "optim/layers.0.attention.q_proj.weight/exp_avg@elems" in manifest  # sharded pieces
    resumed = pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, **common, **{"checkpoint.resume": step}),
        tmp_path / "resumed",
    )
    assert resumed[0] == resumed[1] == full[8:]  # exact float equality, step by step


@pytest.mark.parametrize(
    "saved",
    [
        # A dp=2 DDP checkpoint continuing in one process, exactly: test_train_blend_dist.py's
        # test_blend_resumes_at_another_dp[dp2_to_dp1].
        pytest.param("single", marks=pytest.mark.slow),
        "tp2",
        "fsdp",
        "zero1",
    ],
)
def test_checkpoint_resumes_in_one_process(
    saved: str, pool, kjv_data: Path, uninterrupted: tuple[list, Path], tmp_path: Path
) -> None:
    # Saved by two ranks (``single`` is dp=2 DDP there): TP slices are re-joined, FSDP2 /
    # ZeRO-1 pieces concatenated, then everything is cut for one process.
    pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, parallel=saved, **CONSTANT, **{"trainer.max_steps": 8}),
        tmp_path,
    )
    manifest_names = (tmp_path / "checkpoints" / "step-00000008" / "manifest.json").read_text()
    if saved == "tp2":
        assert "model/layers.0.attention.q_proj.weight@tp1of2" in manifest_names
    if saved == "fsdp":
        assert "model/layers.0.attention.q_proj.weight@elems0-2048of4096" in manifest_names
        # mt-convert joins the pieces too (a strict load_state_dict of every tensor).
        exported = load_model(tmp_path / "checkpoints")
        assert torch.isfinite(exported(torch.arange(8)[None])).all()
    resumed = train_checks.run_losses(
        tiny_overrides(
            kjv_data, **CONSTANT, **{"trainer.max_steps": 12, "checkpoint.resume": "auto"}
        ),
        tmp_path,
    )
    assert resumed == pytest.approx(uninterrupted[0][8:], rel=RTOL)


def test_single_process_checkpoint_resumes_as_zero1(
    pool, kjv_data: Path, uninterrupted: tuple[list, Path], tmp_path: Path
) -> None:
    # A whole-tensor checkpoint (one process) is cut into ZeRO-1's flat shards on load.
    losses, checkpoints = uninterrupted
    resume = {"trainer.max_steps": 12, "checkpoint.resume": checkpoints / "step-00000008"}
    overrides = tiny_overrides(kjv_data, parallel="zero1", **CONSTANT, **resume)
    resumed = pool.run(train_checks.run_losses, overrides, tmp_path)
    assert resumed[0] == pytest.approx(losses[8:], rel=RTOL)


@pytest.mark.parametrize("parallel", ["zero1", "fsdp"])
def test_snapshot_restores_sharded_state(
    parallel: str, pool, kjv_data: Path, tmp_path: Path
) -> None:
    overrides = tiny_overrides(kjv_data, parallel=parallel, **{"model.dropout": 0.1})
    for result in pool.run(train_checks.snapshot_round_trip, overrides, tmp_path):
        assert result["differ"] == []
        assert result["moved"] > 20  # two more steps did change what the restore put back
        assert any(e.startswith("optim/") for e in result["entries"])
        assert any(e.startswith("rng/tracker/") for e in result["entries"])
        assert result["loss"] > 0
