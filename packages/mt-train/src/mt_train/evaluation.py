"""Validation loss and greedy samples of the model being trained.

The validation loss is the loss of ``trainer.eval_batches`` fixed (unshuffled) validation
micro-batches per data-parallel rank, combined as training combines a step's micro-batches,
so it compares across steps and layouts: for data with masked targets (image-text) each
micro-batch's masked mean is weighted by its share of the trained targets
(:func:`mt_train.loss_weights.token_weights`), which makes it the masked mean over every
evaluated target, not a mean of micro-batch means; for text windows (every target trained)
the weights are 1 and it is the mean over dp×cp of the micro-batch means. With ``data.blend`` it is computed so for each source's validation split
(``source_losses``) and reported as their mean weighted by the blend's weights. Samples are greedy continuations run by every rank (TP, CP and FSDP2 layers
communicate; :mod:`mt_train.sample`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import mt_fp8
from mt_comm import ParallelState
from mt_train import ranks
from mt_train.config.schema import TrainConfig
from mt_train.data.blend import BlendedDataModule
from mt_train.data.dataset import Batch, DataModule, PackedDataset, ResumableSampler
from mt_train.loss_weights import token_weights
from mt_train.sample import greedy_generate
from mt_train.step import BatchRunner


class Evaluator:
    """Validation loss and samples on the runner's model (module docstring)."""

    def __init__(
        self,
        runner: BatchRunner,
        data: DataModule,
        cfg: TrainConfig,
        pstate: ParallelState,
        collate: Callable[[Any, Any], Batch],
        tp_group: Any,
        cp_group: Any,
    ) -> None:
        self.runner, self.data, self.cfg, self.collate = runner, data, cfg, collate
        self.dp_rank, self.dp_size = pstate.rank("dp"), pstate.size("dp")
        self.dp_cp_group = pstate.group("dp_cp")
        self.source_losses: dict[str, float] = {}
        """The last :meth:`loss`'s validation loss of each blend source (empty without one)."""
        self.tp_group, self.cp_group = tp_group, cp_group

    @torch.no_grad()
    def loss(self) -> float:
        """Validation loss (module docstring); per source in ``source_losses`` for a blend."""
        if not isinstance(self.data, BlendedDataModule):
            return self._loss(self.data.val)
        parts = self.data.val.parts  # type: ignore[attr-defined]
        self.source_losses = {n: self._loss(p) for n, p in zip(self.data.names, parts, strict=True)}
        weighted = zip(self.data.weights, self.source_losses.values(), strict=True)
        return sum(w * loss for w, loss in weighted)

    def _loss(self, dataset: PackedDataset) -> float:
        tr = self.cfg.trainer
        sampler = ResumableSampler(
            len(dataset), tr.seed, tr.micro_batch_size * self.dp_size * tr.eval_batches,
            tr.micro_batch_size, self.dp_rank, self.dp_size, shuffle=False,
        )  # fmt: skip
        model = self.runner.model
        model.eval()
        total = torch.zeros((), device=self.runner.device)
        micro = sampler.next_step()
        weights = token_weights(dataset, sampler) or [1.0] * len(micro)
        for indices, weight in zip(micro, weights, strict=True):
            total += self.runner.micro_loss(self.collate(dataset, indices))[0] * weight
        model.train()
        # The FP8 weights quantized here would otherwise stay cached until the next eager
        # forward, i.e. for the whole run when the steps are replayed CUDA graphs.
        mt_fp8.clear_fp8_weight_caches(self.runner.module)
        return ranks.mean_scalar(total / len(micro), self.dp_cp_group).item()

    def generate(self, prompt: str, max_new_tokens: int) -> str:
        """Greedy continuation of ``prompt``, the same on every rank (module docstring)."""
        ids = self.data.tokenizer.encode(prompt)
        with self.runner.autocast():
            out = greedy_generate(
                self.runner.module, ids, max_new_tokens, self.cfg.trainer.seq_len,
                self.runner.device, tp_group=self.tp_group, cp_group=self.cp_group,
                sequence_parallel=self.cfg.parallel.sequence_parallel,
            )  # fmt: skip
        return self.data.tokenizer.decode(out)
