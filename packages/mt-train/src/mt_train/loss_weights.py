"""Micro-batch loss weights that make a step's loss the mean over the global batch's trained
targets, for data whose targets are partly masked (image-text: images, prompts, padding).

A masked-mean loss (the VLM's) averages micro-batch ``m`` over its own ``n_m`` trained
targets. The accumulation loop (:mod:`mt_train.step`) and the pipeline schedule
(:mod:`mt_train.pipeline_step`) both start micro-batch ``m``'s backward from
``loss_m · f_m / M`` and data parallelism averages over ``dp`` ranks, so with ``f_m = 1`` the
step's loss is the mean of the micro-batch means, which weighs a target of a micro-batch with
few trained targets more than one of a full micro-batch, and changes with the micro-batch
size. With::

    f_m = n_m · M · dp / N        N = Σ n over the whole global batch

the step's loss is ``Σ_ranks Σ_m n_m · loss_m / N = Σ CE / N``: the masked mean over the whole
global batch, what one process computes on the whole batch at once, at every micro-batch
size, dp and pp (Megatron-LM's per-token loss; Hugging Face's ``num_items_in_batch``). Every
rank computes ``N`` on the host from the sampler's draws of the whole step
(:meth:`~mt_train.data.dataset.ResumableSampler.step_samples`) and the dataset's masks
(``target_counts``), so the weights cost no communication and no device synchronisation.
When all micro-batches hold as many trained targets, ``f_m = 1`` exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def token_weights(dataset: Any, sampler: Any) -> list[float] | None:
    """This rank's ``f_m`` for the sampler's last step (module docstring); None when the
    dataset's targets are never masked (it has no ``target_counts``)."""
    counts_of = getattr(dataset, "target_counts", None)
    if counts_of is None:
        return None
    counts = np.asarray(counts_of(sampler.step_samples()), dtype=np.int64)
    return micro_batch_weights(counts, sampler.micro_batch, sampler.dp_size, sampler.dp_rank)


def micro_batch_weights(
    counts: np.ndarray, micro_batch: int, dp: int, dp_rank: int
) -> list[float] | None:
    """``f_m`` of data-parallel rank ``dp_rank`` from the trained-target counts of a step's
    samples over every rank in draw order (rank ``r``'s micro-batch ``m`` is the slice
    ``[(m·dp + r)·b, (m·dp + r + 1)·b)``); None when no target of the step is trained."""
    micro_batches = len(counts) // (micro_batch * dp)
    per_micro = np.asarray(counts).reshape(micro_batches, dp, micro_batch).sum(-1)[:, dp_rank]
    total = int(np.sum(counts))
    if total == 0:
        return None
    return [int(n) * micro_batches * dp / total for n in per_micro]
