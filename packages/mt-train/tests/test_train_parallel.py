"""Two gloo ranks: dp=2 and tp=2 (with sequence parallel) match one process; TP checkpoints
reshard on load. One pool for the module; the single-process references run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool

# fp32 on CPU; the layouts differ only in summation order (gradient all-reduce, TP partial sums),
# which moves each loss by a few ulps per step; 8 AdamW steps keep that far below 1e-4.
RTOL = 1e-4


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=2) as pool:
        yield pool


@pytest.fixture(scope="module")
def reference(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return train_checks.run_losses(tiny_overrides(kjv_data), tmp_path_factory.mktemp("single"))


def test_dp2_matches_single_process(pool, kjv_data: Path, reference, tmp_path: Path) -> None:
    per_rank = pool.run(train_checks.run_losses, tiny_overrides(kjv_data), tmp_path)
    assert per_rank[0] == per_rank[1]  # every rank reports the dp-mean loss
    assert per_rank[0] == pytest.approx(reference, rel=RTOL)
    assert (tmp_path / "checkpoints" / "step-00000008" / "rank-00001.safetensors").is_file()


def test_tp2_matches_single_process(pool, kjv_data: Path, reference, tmp_path: Path) -> None:
    overrides = tiny_overrides(kjv_data, parallel="tp2")
    per_rank = pool.run(train_checks.run_losses, overrides, tmp_path)
    assert per_rank[0] == pytest.approx(reference, rel=RTOL)
    assert per_rank[1] == pytest.approx(reference, rel=RTOL)


def test_tp2_checkpoint_resumes_at_tp1(pool, kjv_data: Path, tmp_path: Path) -> None:
    common = {"scheduler": "constant"}
    full = train_checks.run_losses(
        tiny_overrides(kjv_data, **common, **{"trainer.max_steps": 12}), tmp_path / "single"
    )
    pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, parallel="tp2", **common, **{"trainer.max_steps": 8}),
        tmp_path / "split",
    )
    manifest_names = (
        tmp_path / "split" / "checkpoints" / "step-00000008" / "manifest.json"
    ).read_text()
    assert "model/layers.0.attention.q_proj.weight@tp1of2" in manifest_names
    resumed = train_checks.run_losses(
        tiny_overrides(
            kjv_data, **common, **{"trainer.max_steps": 12, "checkpoint.resume": "auto"}
        ),
        tmp_path / "split",
    )
    assert resumed == pytest.approx(full[8:], rel=RTOL)


def test_dp2_checkpoint_resumes_in_one_process(pool, kjv_data: Path, tmp_path: Path) -> None:
    common = {"scheduler": "constant"}
    full = train_checks.run_losses(
        tiny_overrides(kjv_data, **common, **{"trainer.max_steps": 12}), tmp_path / "single"
    )
    pool.run(
        train_checks.run_losses,
        tiny_overrides(kjv_data, **common, **{"trainer.max_steps": 8}),
        tmp_path / "split",
    )
    resumed = train_checks.run_losses(
        tiny_overrides(
            kjv_data, **common, **{"trainer.max_steps": 12, "checkpoint.resume": "auto"}
        ),
        tmp_path / "split",
    )
    assert resumed == pytest.approx(full[8:], rel=RTOL)
