"""The default multimodal job learns to read digits: greedy captions of the held-out images
name the right digit. The full job (``mt-train model=vlm_tiny data=digits``) is the slow test
(>= 95% and at least scikit-learn's logistic regression on the same split); the default tier
trains a shorter run to a lower bar and checks that the captions come from the image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import train_checks

from mt_train.models.vlm.captions import (
    digit_accuracy,
    greedy_captions,
    logistic_regression_accuracy,
)

pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")

QUIET = ["logging.progress_bar=false", "checkpoint.enabled=false"]


def train_and_caption(overrides: list[str], output_dir: Path) -> tuple[float, float, Path]:
    """Train; the held-out caption accuracy, that with blank images, and the data folder."""
    trainer, _ = train_checks.fit(["model=vlm_tiny", "data=digits", *QUIET, *overrides], output_dir)
    val = trainer.data.val
    indices = list(range(len(val)))
    accuracy = digit_accuracy(*greedy_captions(trainer.module, val, indices))
    blank = BlankImages(val)
    blind = digit_accuracy(*greedy_captions(trainer.module, blank, indices))
    return accuracy, blind, trainer.data.folder


class BlankImages:
    """A dataset view whose images are all zero: what a caption that ignores the image gets."""

    def __init__(self, data) -> None:
        self.data, self.eos_id, self.normalize = data, data.eos_id, data.normalize

    def sample(self, i: int):
        ids, mask, images = self.data.sample(i)
        return ids, mask, np.zeros_like(images)


def test_short_run_reads_the_digit_from_the_image(tmp_path: Path) -> None:
    # 180 steps with a 10-step warmup: past the image-blind plateau (loss ln(10)/16 per token)
    # but not converged, so the bar is lower than the full job's.
    accuracy, blind, _ = train_and_caption(
        ["trainer.max_steps=180", "trainer.eval_interval=180", "scheduler.warmup_steps=10"],
        tmp_path,
    )
    assert accuracy >= 0.6
    assert blind <= 0.25  # one blank image gets one caption: at most a digit's share or two


@pytest.mark.slow
def test_default_job_captions_beat_logistic_regression(tmp_path: Path) -> None:
    accuracy, blind, folder = train_and_caption([], tmp_path)
    baseline = logistic_regression_accuracy(folder)
    assert accuracy >= 0.95 and accuracy >= baseline, (accuracy, baseline)
    assert blind <= 0.25
