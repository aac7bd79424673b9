"""``trainer.cuda_graph``: what it refuses (CPU), and on a GPU that replayed steps train exactly
as eager ones, through gradient accumulation, evaluation, FP8 recipes and a rewind."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from train_checks import rewind_overrides, run_rewind, tiny_overrides

from mt_train import Trainer, compose_config, to_train_config
from mt_train.cuda_graph import cuda_graph_blockers


def test_cuda_graph_refuses_a_cpu_run(kjv_data: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(kjv_data, **{"trainer.device": "cpu", "trainer.cuda_graph": True})
    with pytest.raises(ValueError, match=r"trainer\.cuda_graph=true .*device 'cpu' is not cuda"):
        Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)


def test_cuda_graph_blockers_name_each_reason() -> None:
    assert cuda_graph_blockers("cuda", 1, 1, 1, 0.0, "ddp", 1) == []
    assert cuda_graph_blockers("cuda", 1, 1, 1, 0.0, "none", 4) == []
    assert cuda_graph_blockers("cuda", 1, 1, 1, 0.0, "zero1", 4) == []
    reasons = cuda_graph_blockers("cuda", 2, 2, 1, 0.1, "fsdp", 4)
    assert len(reasons) == 4
    assert "parallel.tp=2" in reasons[0] and "parallel.cp=2" in reasons[1]
    assert "parallel.data_parallel=fsdp over 4 ranks" in reasons[2]
    assert "model.dropout=0.1" in reasons[3]


def _losses(overrides: list[str], out: Path, graphed: bool) -> tuple[list[float], bool]:
    """Per-step losses of a fit, and whether a step graph was captured."""
    cfg = to_train_config(compose_config([*overrides, f"trainer.cuda_graph={graphed}"]))
    trainer = Trainer(cfg, output_dir=out)
    try:
        summary = trainer.fit()
        return summary.losses, trainer.step_graph is not None
    finally:
        trainer.close()


def _graphed_equals_eager(overrides: list[str], tmp_path: Path) -> list[float]:
    """Fit eagerly and with the step graph; the graphed run captured a graph and its per-step
    losses are the eager run's to 1e-4 (the bound of test_graphed_steps_train_as_eager_steps).
    Returns the eager losses."""
    eager, _ = _losses(overrides, tmp_path / "eager", graphed=False)
    graphed, captured = _losses(overrides, tmp_path / "graphed", graphed=True)
    assert captured
    assert graphed == pytest.approx(eager, rel=1e-4), (graphed, eager)
    return eager


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", ["none", "tensorwise", "delayed", "blockwise"])
def test_graphed_steps_train_as_eager_steps(kjv_data: Path, tmp_path: Path, fp8: str) -> None:
    # Two micro-batches per step (accumulation inside the graph), an evaluation at step 6 (eager
    # forwards between replays), FP8 scales and histories updated in place between replays.
    # The replay runs the eager step's kernels on the same data; the bound allows for cuBLAS
    # choosing another algorithm under capture (bf16 rounding of one GEMM, ~1e-3 relative,
    # would show as ~1e-4 in the mean loss); a replay on stale inputs, weights or gradients
    # moves the loss by percents after a few steps. Width 128: the block recipe needs features
    # divisible by 128 (the 64-wide k/v projections stay high precision by min_features).
    overrides = tiny_overrides(
        kjv_data,
        **{
            "trainer.device": "cuda",
            "fp8": fp8,
            "fp8.min_features": 128,
            "model.dim": 128,
            "model.ffn_dim": 256,
            "trainer.max_steps": 12,
            "trainer.eval_interval": 6,
            "optimizer.lr": 3e-3,
        },
    )
    eager = _graphed_equals_eager(overrides, tmp_path)
    assert eager[-1] < 0.9 * eager[0], eager  # it trains


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flex", "explicit"])
def test_graphed_document_masked_steps_train_as_eager_steps(
    kjv_data: Path, tmp_path: Path, kernel: str
) -> None:
    # Document masks rebuilt from each micro-batch's document ids inside the captured step
    # (FlexAttention's block mask, or SDPA's boolean mask): a replay that kept the captured
    # step's masks would attend across other documents and leave the eager losses. Bound as
    # above.
    overrides = tiny_overrides(
        kjv_data,
        **{
            "trainer.device": "cuda",
            "data.document_masking": True,
            "data.document_masking_kernel": kernel,
            "trainer.max_steps": 10,
            "trainer.eval_interval": 5,
            "optimizer.lr": 3e-3,
        },
    )
    _graphed_equals_eager(overrides, tmp_path)


@pytest.mark.gpu
def test_a_graphed_run_rewinds_as_an_eager_run(kjv_data: Path, tmp_path: Path) -> None:
    # The NaN step runs eagerly (a fault factor changes its kernels); the rewind restores the
    # parameters in place and drops the graph, which the next step captures again. Bound as
    # above, over a longer run.
    overrides = rewind_overrides(
        kjv_data, **{"trainer.device": "cuda", "fault.nan_at_step": 30, "fp8": "tensorwise"}
    )
    eager = run_rewind(overrides, tmp_path / "eager")
    graphed = run_rewind([*overrides, "trainer.cuda_graph=true"], tmp_path / "graphed")
    assert graphed["rewinds"] == eager["rewinds"] == 1
    assert graphed["steps"] == eager["steps"]
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=1e-3, nan_ok=True)
    assert torch.isfinite(torch.tensor(graphed["val_loss"]))


@pytest.mark.gpu
def test_the_graph_computes_the_gradient_norm_the_eager_step_computes(
    kjv_data: Path, tmp_path: Path
) -> None:
    # One data-parallel rank: the norm is captured with the backward (mt_train.cuda_graph).
    # The per-step norms are the clipping's input, so a stale or wrong captured norm (e.g. of
    # the capture's gradients) would differ by far more than the bound above allows.
    overrides = tiny_overrides(
        kjv_data, **{"trainer.device": "cuda", "fp8": "tensorwise", "optimizer.lr": 3e-3}
    )
    norms = {}
    for graphed in (False, True):
        cfg = to_train_config(compose_config([*overrides, f"trainer.cuda_graph={graphed}"]))
        trainer = Trainer(cfg, output_dir=tmp_path / str(graphed))
        try:
            norms[graphed] = [trainer.train_step()["grad_norm"] for _ in range(5)]
            if graphed:
                assert trainer.step_graph is not None and trainer.step_graph.norm is not None
        finally:
            trainer.close()
    assert len(set(norms[True])) == 5  # a new norm every step
    assert norms[True] == pytest.approx(norms[False], rel=1e-4), norms


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True])
def test_a_delayed_fp8_step_synchronises_with_the_host_once(
    kjv_data: Path, tmp_path: Path, graphed: bool
) -> None:
    # The one intended sync is the transfer of the numbers the detectors judge (loss, norm, FP8
    # saturation). Any other (a blocking host-to-device copy, an .item()) holds the host until
    # the queued kernels finish, and the device then idles while the host launches what follows;
    # the delayed-scaling update once made one per step. PyTorch's sync debug mode warns once
    # per synchronising call.
    overrides = tiny_overrides(
        kjv_data,
        **{
            "trainer.device": "cuda",
            "trainer.cuda_graph": graphed,
            "fp8": "delayed",
            "fp8.min_features": 128,
            "model.dim": 128,
            "model.ffn_dim": 256,
            "rewind": "default",
        },
    )
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)
    try:
        assert trainer.watch_fp8
        for _ in range(3):  # graphed: eager warm-up, capture, first replay
            trainer.train_step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [
            f"{w.filename}:{w.lineno}: {w.message}"
            for w in caught
            if "called a synchronizing CUDA operation" in str(w.message)
        ]
        assert graphed == (trainer.step_graph is not None)
        assert len(syncs) == 1, syncs
    finally:
        trainer.close()


@pytest.mark.gpu
def test_graphed_vlm_steps_carry_each_steps_images(digits: Path, tmp_path: Path) -> None:
    # The step graph copies each micro-batch's images into its own buffer: a replay that kept
    # the captured step's images (or none) would train on the wrong pictures and its losses
    # would leave the eager run's after the first replays. Bound as above.
    pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")
    overrides = [
        "model=vlm_tiny", "data=digits", f"data.path={digits}", "trainer.device=cuda",
        "trainer.seq_len=32", "trainer.max_steps=10", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4", "trainer.eval_interval=5", "trainer.eval_batches=1",
        "scheduler.warmup_steps=1", "checkpoint.enabled=false", "logging.progress_bar=false",
        "model.dropout=0.0",  # a graph would replay the captured step's dropout masks
    ]  # fmt: skip
    _graphed_equals_eager(overrides, tmp_path)


@pytest.mark.gpu
def test_graphed_packed_vlm_steps_train_as_eager_steps(tmp_path: Path) -> None:
    # Packed rows of samples with zero, one or two images: the batches' image counts differ,
    # so the captured step takes each batch padded to a fixed count (zero images no
    # placeholder takes) while the eager step takes the batch's own. Bound as above.
    from test_train_vlm_packing import SEQ_LEN, prepare_varied

    (tmp_path / "data").mkdir()
    prepare_varied(tmp_path / "data", val_every=2)  # five held-out samples: one sequence
    overrides = [
        "model=vlm_tiny", f"data.path={tmp_path / 'data' / 'out'}", "trainer.device=cuda",
        "data.pack_samples=true", f"trainer.seq_len={SEQ_LEN}", "trainer.max_steps=10",
        "trainer.global_batch_size=2", "trainer.micro_batch_size=1", "trainer.eval_interval=5",
        "trainer.eval_batches=1", "scheduler.warmup_steps=1", "checkpoint.enabled=false",
        "logging.progress_bar=false", "model.dropout=0.0",
    ]  # fmt: skip
    _graphed_equals_eager(overrides, tmp_path)
