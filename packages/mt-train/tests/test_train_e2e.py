"""The default job end to end (shortened), exact resume, and rewind by fault injection."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from train_checks import run_losses, tiny_overrides

from mt_train import Trainer, compose_config, to_train_config
from mt_train.rewind.manager import RewindLimitError


def test_default_job_shortened_learns(tmp_path: Path) -> None:
    # The default config, only shorter: the bundled corpus is prepared on first use. 24 steps
    # take the mean of the last 5 losses well below 0.75 of the first 5's; a run that does not
    # learn stays near 1.
    overrides = [
        "trainer.max_steps=24",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.seq_len=128",
        "trainer.eval_interval=12",
        "trainer.checkpoint_interval=12",
        "trainer.eval_batches=4",
        "trainer.sample_tokens=24",
        "scheduler.warmup_steps=5",
        "logging.progress_bar=false",
    ]
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    losses = summary.losses
    assert len(losses) == 24
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5, losses
    assert summary.val_loss < losses[0] and math.isfinite(summary.val_loss)
    assert summary.sample.startswith("And God said") and len(summary.sample) > len("And God said")
    assert (tmp_path / "data" / "meta.json").is_file()
    assert summary.checkpoint is not None and summary.checkpoint.endswith("step-00000024")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert {"loss", "grad_norm", "lr", "tok/s", "mem_gib"} <= set(train[0])
    assert [r["step"] for r in records if r["kind"] == "eval"] == [12, 24]


def test_resume_is_bitwise_identical(kjv_data: Path, tmp_path: Path) -> None:
    # A constant schedule after warmup, so stopping at step 8 does not change the LR curve.
    common = {"scheduler": "constant"}
    full = run_losses(
        tiny_overrides(kjv_data, **common, **{"trainer.max_steps": 12}), tmp_path / "full"
    )
    first = run_losses(
        tiny_overrides(kjv_data, **common, **{"trainer.max_steps": 8}), tmp_path / "split"
    )
    assert first == full[:8]
    resumed = run_losses(
        tiny_overrides(
            kjv_data, **common, **{"trainer.max_steps": 12, "checkpoint.resume": "auto"}
        ),
        tmp_path / "split",
    )
    assert resumed == full[8:]  # exact float equality, step by step


def _inject_nan_at(trainer: Trainer, step: int) -> list[int]:
    """Make the loss non-finite once, while computing step ``step`` (1-based)."""
    real, fired = trainer.runner.micro_loss, []

    def faulty(batch):
        loss, extras = real(batch)
        if trainer.step + 1 == step and not fired:
            fired.append(trainer.step)
            return loss * float("nan"), extras
        return loss, extras

    trainer.runner.micro_loss = faulty  # type: ignore[method-assign]
    return fired


def test_rewind_restores_checkpoint_and_skips_bad_data(kjv_data: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(
        kjv_data, rewind="default", **{"trainer.max_steps": 8, "rewind.stable_after": 1}
    )
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)
    fired = _inject_nan_at(trainer, step=6)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert fired == [5] and summary.rewinds == 1 and summary.steps == 8
    assert trainer.guard.cooldown == {"start": 4, "steps": 20, "factor": 0.5}
    # Steps 5 and 6 were redone from the step-4 checkpoint on later batches: 8 + 2 losses kept.
    assert len(summary.losses) == 9 and all(math.isfinite(x) for x in summary.losses)
    assert trainer.sampler.consumed == (8 + 2) * 8  # the two skipped batches stay consumed
    kinds = [
        json.loads(line)["kind"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert kinds.count("anomaly") == 1 and kinds.count("rewind") == 1


def test_nonfinite_loss_without_rewind_stops(kjv_data: Path, tmp_path: Path) -> None:
    trainer = Trainer(
        to_train_config(compose_config(tiny_overrides(kjv_data))), output_dir=tmp_path
    )
    _inject_nan_at(trainer, step=3)
    try:
        with pytest.raises(RewindLimitError, match="rewind: stopped at step 3: non_finite") as err:
            trainer.fit()
    finally:
        trainer.close()
    assert "rewind=default would have restored" in str(err.value)
    assert torch.isfinite(trainer.module.output.weight).all()  # the bad step was never applied


GOLDEN = Path(__file__).parent / "data" / "golden_tiny_losses.json"


def test_golden_loss_curve(kjv_data: Path, tmp_path: Path) -> None:
    """16 steps of the tiny debug model on the bundled corpus against the stored curve.

    fp32 on a CPU: a different SIMD width changes reduction order and moves each loss by
    ~1e-6 relative, and 16 AdamW steps keep that well under 1e-4; any change to the model,
    init, data order or optimizer moves the curve by far more. After an intended change,
    regenerate the file with the overrides recorded in it.
    """
    golden = json.loads(GOLDEN.read_text())
    steps = {
        "trainer.max_steps": 16,
        "trainer.eval_interval": 16,
        "trainer.checkpoint_interval": 16,
    }
    losses = run_losses(tiny_overrides(kjv_data, **steps), tmp_path)
    assert losses == pytest.approx(golden["losses"], rel=1e-4)
    assert losses[-1] < 0.8 * losses[0]


def test_tensorboard_events_written(kjv_data: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    run_losses(tiny_overrides(kjv_data, logging="tensorboard"), tmp_path)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_fused_adamw_clips_inside_the_update(kjv_data: Path, tmp_path: Path) -> None:
    # Fused AdamW applies the clip as its kernel's grad_scale divisor; the per-element update
    # must equal the unfused clip-then-step. AdamW is nearly invariant to a constant gradient
    # scale, so compare the first moments, which carry the clipped gradients linearly: a missed
    # clip (grad_clip=0.05 against norms of order 1) would leave them 20x or more too large.
    # The bound: the two kernels round differently in fp32 (a few ulps per step, 8 steps).
    moments = {}
    for fused in (False, True):
        overrides = tiny_overrides(
            kjv_data,
            **{"optimizer.grad_clip": 0.05, "optimizer.impl": "fused" if fused else "foreach"},
        )
        out = tmp_path / str(fused)
        trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=out)
        try:
            trainer.fit()
        finally:
            trainer.close()
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        norms = [r["grad_norm"] for r in records if r["kind"] == "train"]
        assert norms and min(norms) > 0.05, norms  # the clip is active at every logged step
        moments[fused] = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]
    for unfused, fused in zip(moments[False], moments[True], strict=True):
        torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-7)


def test_fp8_training_with_fused_adamw_matches_foreach(kjv_data: Path, tmp_path: Path) -> None:
    # Fused AdamW (the default on GPUs) updates weights without bumping their version counters;
    # FP8 layers must still re-quantize their weights after every step. The two AdamW kernels
    # round differently in fp32, so the losses may differ in the last bits (bound 1e-4 relative
    # over 8 steps); serving the first step's FP8 weights moves them by percents.
    losses = {}
    for fused in (False, True):
        impl = "fused" if fused else "foreach"
        overrides = tiny_overrides(
            kjv_data, **{"fp8": "tensorwise", "optimizer.impl": impl, "optimizer.lr": 3e-3}
        )
        losses[fused] = run_losses(overrides, tmp_path / str(fused))
    assert losses[True] == pytest.approx(losses[False], rel=1e-4), losses
