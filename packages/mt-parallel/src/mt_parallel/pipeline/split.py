"""Cutting a decoder LM into pipeline chunks.

A model that pipelines declares its :class:`PipelineLayout` in its
:class:`~mt_parallel.ParallelizePlan` (``plan.pipeline``): the embedding module, the block list,
and the modules after the blocks (final norm, output head), so that its forward is::

    x = embedding(tokens);  x = block(x, positions, document_ids) for each block;
    logits = final[-1](… final[0](x))

:func:`split_layers` cuts ``L`` blocks into ``C`` consecutive chunks (``C = pp·v``): a user list
(``parallel.pp_layers``), or automatically ``⌊L/C⌋`` blocks each with the remainder given to
the middle chunks first, so the chunks that also hold the embedding (chunk 0) and the head
(chunk ``C−1``) get the fewest. :class:`PipelineChunk` is one chunk as a module: the first
holds the embedding, the last the final modules, each its blocks under their original indices,
so a chunk's ``state_dict`` keys are the whole model's (``layers.5.…`` stays ``layers.5.…``) and
checkpoints move between pipeline layouts by name.

A chunk holding MoE layers attaches their auxiliary losses to the hidden states after its
blocks (:mod:`mt_parallel.moe.carry`: the gradient reaches the routers in the backward, no
value crosses stages) when the schedule passes ``aux_loss_scale``, and keeps each
micro-batch's record of them in :attr:`PipelineChunk.aux_records` for the step's metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mt_parallel.moe.carry import AuxLossScale, carry_aux_losses
from mt_parallel.moe.layer import moe_layers


@dataclass(frozen=True)
class PipelineLayout:
    """Where a model's pipeline pieces are (module docstring)."""

    embedding: str
    """Attribute of the token embedding (runs on the first chunk)."""
    blocks: str
    """Attribute of the ``nn.ModuleList`` of blocks, each ``block(x, positions, document_ids)``."""
    final: tuple[str, ...]
    """Attributes applied in order after the blocks on the last chunk (norm, output head)."""


def split_layers(
    num_layers: int, num_chunks: int, layers: Sequence[int] | None = None
) -> list[range]:
    """The blocks of each chunk as consecutive index ranges (module docstring)."""
    if num_chunks < 1:
        raise ValueError(f"a pipeline needs at least one chunk, got {num_chunks}")
    if layers:
        counts = list(layers)
        if len(counts) != num_chunks:
            raise ValueError(
                f"parallel.pp_layers={counts} has {len(counts)} entries; the pipeline has "
                f"{num_chunks} chunks (pp·pp_chunks)"
            )
        if any(not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"parallel.pp_layers={counts} must be non-negative integers")
        if sum(counts) != num_layers:
            raise ValueError(
                f"parallel.pp_layers={counts} sums to {sum(counts)}, the model has "
                f"{num_layers} layers"
            )
    else:
        if num_layers < num_chunks:
            raise ValueError(
                f"{num_layers} layers cannot be split into {num_chunks} pipeline chunks "
                "(pp·pp_chunks) of at least one layer each; lower pp or pp_chunks, or give "
                "parallel.pp_layers (chunks may be empty there)"
            )
        base, extra = divmod(num_layers, num_chunks)
        counts = [base] * num_chunks
        middle_first = [*range(1, num_chunks - 1), 0, num_chunks - 1]
        for chunk in middle_first[:extra] if num_chunks > 2 else range(extra):
            counts[chunk] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


class PipelineChunk(nn.Module):
    """One pipeline chunk of a model (module docstring); ``forward(x, positions, document_ids)``
    takes token ids on the first chunk and hidden states elsewhere, and returns hidden states,
    or the logits on the last chunk."""

    def __init__(
        self,
        model: nn.Module,
        layout: PipelineLayout,
        blocks: range,
        first: bool,
        last: bool,
    ) -> None:
        super().__init__()
        self.layout, self.first, self.last = layout, first, last
        self.block_ids = blocks
        if first:
            self.add_module(layout.embedding, getattr(model, layout.embedding))
        all_blocks = getattr(model, layout.blocks)
        self.add_module(layout.blocks, nn.ModuleDict({str(i): all_blocks[i] for i in blocks}))
        if last:
            for name in layout.final:
                self.add_module(name, getattr(model, name))
        self.loss_fn: Callable | None = model.loss if last and hasattr(model, "loss") else None
        self.moe_layers = moe_layers(self)
        self.aux_records: dict[int, torch.Tensor] = {}
        """Micro-batch -> this chunk's MoE record (:mod:`mt_parallel.moe.carry`) of the step."""

    @property
    def carries_aux_losses(self) -> bool:
        return bool(self.moe_layers)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        aux_loss_scale: AuxLossScale | None = None,
    ) -> torch.Tensor:
        if self.first:
            x = getattr(self, self.layout.embedding)(x)
        for block in getattr(self, self.layout.blocks).values():
            x = block(x, positions, document_ids)
        if self.moe_layers:
            x, record = carry_aux_losses(self.moe_layers, x, aux_loss_scale)
            if record is not None and aux_loss_scale is not None:
                self.aux_records[aux_loss_scale.microbatch] = record
        if self.last:
            for name in self.layout.final:
                x = getattr(self, name)(x)
        return x


def split_model(
    model: nn.Module,
    layout: PipelineLayout,
    stage_ids: Sequence[int],
    num_stages: int,
    layers: Sequence[int] | None = None,
) -> list[PipelineChunk]:
    """The chunks ``stage_ids`` (global indices, ascending) of ``model`` cut into
    ``num_stages`` chunks; modules of other chunks are not referenced by the result."""
    ranges = split_layers(len(getattr(model, layout.blocks)), num_stages, layers)
    return [PipelineChunk(model, layout, ranges[s], s == 0, s == num_stages - 1) for s in stage_ids]
