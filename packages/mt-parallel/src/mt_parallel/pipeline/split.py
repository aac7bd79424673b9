"""Cutting a decoder LM into pipeline chunks.

A model that pipelines declares its :class:`PipelineLayout` in its
:class:`~mt_parallel.ParallelizePlan` (``plan.pipeline``): the embedding module, the block list,
and the modules after the blocks (final norm, output head), so that its forward is::

    x = embedding(tokens);  x = block(x, positions, document_ids) for each block;
    logits = final[-1](… final[0](x))

Names are module paths (``language.layers`` for a decoder inside a larger model). A model whose
first stage does more than look tokens up (a vision-language model merging image features
into the embeddings) names the extra modules its first chunk holds (``first_extra``), the
function that computes the first chunk's hidden states from them (``embed(chunk, tokens,
positions, **inputs)``, given the chunk, whose module names are the model's) and the keyword
inputs only that function reads (``first_inputs``, the images: every chunk receives a
micro-batch's keywords, the others drop these); ``last_extra`` names further modules the last
chunk holds (a loss module that reduces over the cp group, multi-token-prediction blocks);
``block_positions`` names a keyword input every chunk's blocks take as their positions (the
per-sample RoPE positions of packed samples).

A model whose last chunk does more than apply ``final`` (DeepSeek-V3's multi-token prediction,
a head tied to the embedding) names a method of the model computing the last chunk's output
from the blocks' hidden states (``head``: ``model.<head>(x, positions, document_ids,
**inputs)``, run on the model's own modules, which are the chunk's) and the keyword inputs only
it reads (``last_inputs``: the shifted tokens). Modules of the first chunk that the head also
runs (``last_shared``: the input embedding) are held by the last chunk too; when another rank
holds the first chunk, the last chunk's rank keeps its own copy (Megatron's embedding group):
:class:`~mt_parallel.PipelineModule` starts it equal to the first chunk's and sums the two
gradients after each step (both ranks add the same two tensors, so the copies stay equal
bit for bit under any optimizer), and the copy's parameters are marked
``pipeline_copy`` so that norms and checkpoints count each parameter once. When one rank
holds the first and last chunks (the V schedules), both chunks hold the one module
(:func:`detached` keeps it out of the later chunk while that one is transformed or, under
FSDP2, initialised: :mod:`mt_parallel.pipeline.shared_fsdp`).

:func:`split_layers` cuts ``L`` blocks into ``C`` consecutive chunks (``C = pp·v``): a user list
(``parallel.pp_layers``), or automatically ``⌊L/C⌋`` blocks each with the remainder given to
the middle chunks first, so the chunks that also hold the embedding (chunk 0) and the head
(chunk ``C−1``) get the fewest. :class:`PipelineChunk` is one chunk as a module: the first
holds the embedding (and ``first_extra``), the last the final modules (and ``last_extra``),
each its blocks under their original indices, every module at its path in the model, so a
chunk's ``state_dict`` keys are the whole model's (``layers.5.…`` stays ``layers.5.…``) and
checkpoints move between pipeline layouts by name.

A chunk holding MoE layers attaches their auxiliary losses to its output, on the last chunk
after the head so that the losses of MoE layers the head runs (multi-token-prediction blocks)
are included (:mod:`mt_parallel.moe.carry`: the gradient reaches the routers in the backward,
no value crosses stages) when the schedule passes ``aux_loss_scale``, and keeps each
micro-batch's record of them in :attr:`PipelineChunk.aux_records` for the step's metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mt_parallel.moe.carry import AuxLossScale, carry_aux_losses
from mt_parallel.moe.layer import moe_layers


@dataclass(frozen=True)
class PipelineLayout:
    """Where a model's pipeline pieces are (module docstring); every name is a module path."""

    embedding: str
    """The token embedding (runs on the first chunk)."""
    blocks: str
    """The ``nn.ModuleList`` of blocks, each ``block(x, positions, document_ids)``."""
    final: tuple[str, ...]
    """Modules applied in order after the blocks on the last chunk (norm, output head)."""
    first_extra: tuple[str, ...] = ()
    """Further modules the first chunk holds, for ``embed`` (an image encoder, a projector)."""
    embed: Callable[..., torch.Tensor] | None = None
    """The first chunk's hidden states, ``embed(chunk, tokens, positions, **inputs)``; None:
    ``embedding(tokens)``."""
    first_inputs: tuple[str, ...] = ()
    """Keyword inputs of a micro-batch read by ``embed`` only; other chunks drop them."""
    last_extra: tuple[str, ...] = ()
    """Further modules the last chunk holds (the model's loss module, MTP blocks)."""
    head: str | None = None
    """A model method giving the last chunk's output, ``model.<head>(x, positions,
    document_ids, **inputs)``; None: the ``final`` modules in order."""
    last_inputs: tuple[str, ...] = ()
    """Keyword inputs of a micro-batch read by ``head`` only; other chunks drop them."""
    last_shared: tuple[str, ...] = ()
    """Modules of the first chunk the last chunk's ``head`` also runs (the input embedding):
    held by both, their gradients summed between the two (module docstring)."""
    block_positions: str | None = None
    """A keyword input of every chunk that, when a micro-batch has it, the blocks take as their
    ``positions`` instead of the tokens' (a vision-language model's packed samples: RoPE
    positions restarting at each sample, ``(B, T)``); ``embed`` still gets the tokens'."""


def place_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at the dotted ``path`` under ``root``, adding empty containers."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = dict(node.named_children()).get(name)
        if child is None:
            child = nn.Module()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


@contextlib.contextmanager
def detached(root: nn.Module, paths: Sequence[str]) -> Iterator[None]:
    """``root`` without the modules at the dotted ``paths`` while the context lasts; each comes
    back at its own position, so parameter and state-dict order are unchanged. The other
    children are kept as they are then: a transform may have replaced one (FP8's linears)."""
    saved = []
    for path in paths:
        *parents, leaf = path.split(".")
        parent = root.get_submodule(".".join(parents))
        saved.append((parent, list(parent._modules), leaf, parent._modules.pop(leaf)))
    try:
        yield
    finally:
        for parent, order, leaf, module in reversed(saved):
            children = {**parent._modules, leaf: module}
            parent._modules.clear()
            parent._modules.update({name: children.pop(name) for name in order if name in children})
            parent._modules.update(children)  # children the context added, after the others


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
    """One pipeline chunk of a model (module docstring); ``forward(x, positions, document_ids,
    **inputs)`` takes token ids on the first chunk and hidden states elsewhere, and returns
    hidden states, or the logits on the last chunk."""

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
        before = [layout.embedding, *layout.first_extra] if first else []
        after = [
            p
            for p in (*layout.final, *layout.last_extra, *layout.last_shared)
            if last and p not in before
        ]
        for path in before:
            place_module(self, path, model.get_submodule(path))
        all_blocks = model.get_submodule(layout.blocks)
        place_module(self, layout.blocks, nn.ModuleDict({str(i): all_blocks[i] for i in blocks}))
        for path in after:
            place_module(self, path, model.get_submodule(path))
        self.held_paths = (*before, *after)
        """The paths of the modules this chunk holds besides its blocks."""
        self.loss_fn: Callable | None = model.loss if last and hasattr(model, "loss") else None
        self.head_fn: Callable[..., torch.Tensor] | None = (
            getattr(model, layout.head) if last and layout.head else None
        )
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
        **inputs: Any,
    ) -> torch.Tensor:
        layout = self.layout
        every = () if layout.block_positions is None else (layout.block_positions,)
        unknown = sorted(set(inputs) - {*layout.first_inputs, *layout.last_inputs, *every})
        if unknown:
            raise TypeError(
                f"pipeline chunk got keyword inputs {unknown}; its layout's first chunk reads "
                f"{list(layout.first_inputs)}, its last {list(layout.last_inputs)} and every "
                f"chunk {list(every)}"
            )
        if self.first and layout.embed is not None:
            first_inputs = {k: v for k, v in inputs.items() if k in layout.first_inputs}
            x = layout.embed(self, x, positions, **first_inputs)
        elif self.first:
            x = self.get_submodule(layout.embedding)(x)
        block_positions = inputs.get(layout.block_positions) if every else None
        block_positions = positions if block_positions is None else block_positions
        for block in self.get_submodule(layout.blocks).values():
            x = block(x, block_positions, document_ids)
        if self.last and self.head_fn is not None:
            last_inputs = {k: v for k, v in inputs.items() if k in layout.last_inputs}
            x = self.head_fn(x, positions, document_ids, **last_inputs)
        elif self.last:
            for name in layout.final:
                x = self.get_submodule(name)(x)
        if self.moe_layers:
            x, record = carry_aux_losses(self.moe_layers, x, aux_loss_scale)
            if record is not None and aux_loss_scale is not None:
                self.aux_records[aux_loss_scale.microbatch] = record
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
    ranges = split_layers(len(model.get_submodule(layout.blocks)), num_stages, layers)
    return [PipelineChunk(model, layout, ranges[s], s == 0, s == num_stages - 1) for s in stage_ids]
