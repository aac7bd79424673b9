"""Micro-batch loss weights (mt_train.loss_weights): the sampler's whole step in draw order,
and weights that turn the mean of micro-batch means over dp ranks into the masked mean over
the whole global batch."""

from __future__ import annotations

import numpy as np
import pytest

from mt_train.data.dataset import ResumableSampler
from mt_train.loss_weights import micro_batch_weights, token_weights


class Counted:
    """A dataset whose sample ``i`` has ``i % 7`` trained targets."""

    def target_counts(self, indices: np.ndarray) -> np.ndarray:
        return np.asarray(indices) % 7


def samplers(dp: int) -> list[ResumableSampler]:
    return [ResumableSampler(100, 3, 12, 2, dp_rank=r, dp_size=dp) for r in range(dp)]


def test_step_samples_are_every_rank_s_micro_batches_in_draw_order() -> None:
    ranks = samplers(3)
    micro = [s.next_step() for s in ranks]  # two micro-batches of 2 per rank
    for s in ranks:
        whole = s.step_samples().reshape(2, 3, 2)  # (micro-batch, rank, row)
        for r, batches in enumerate(micro):
            for m, batch in enumerate(batches):
                assert whole[m, r].tolist() == batch.tolist()


def test_weighted_mean_of_micro_batch_means_is_the_global_masked_mean() -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 30, size=12)  # 2 micro-batches × 3 ranks × 2 rows
    per_target = rng.normal(size=int(counts.sum()))  # every trained target's cross-entropy
    sums = np.add.reduceat(per_target, np.concatenate([[0], np.cumsum(counts)[:-1]]))
    means = sums.reshape(2, 3, 2).sum(-1) / counts.reshape(2, 3, 2).sum(-1)  # (m, rank)
    reported = np.mean(
        [
            np.mean([f * means[m, r] for m, f in enumerate(micro_batch_weights(counts, 2, 3, r))])
            for r in range(3)
        ]
    )  # the trainer: each rank's Σ f_m·loss_m / M, averaged over dp
    assert reported == pytest.approx(per_target.mean(), rel=1e-12)
    assert micro_batch_weights(np.full(12, 5), 2, 3, 1) == [1.0, 1.0]  # exactly
    assert micro_batch_weights(np.zeros(12, np.int64), 2, 3, 1) is None


def test_token_weights_read_the_dataset_counts_of_the_whole_step() -> None:
    ranks = samplers(2)
    for s in ranks:
        s.next_step()
    weights = [token_weights(Counted(), s) for s in ranks]
    counts = Counted().target_counts(ranks[0].step_samples())
    assert weights == [micro_batch_weights(counts, 2, 2, r) for r in range(2)]
    assert token_weights(object(), ranks[0]) is None  # text data: no masked targets
