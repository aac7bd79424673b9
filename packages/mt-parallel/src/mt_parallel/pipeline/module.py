"""One rank's pipeline chunks as a single module with the whole model's parameter names.

:class:`PipelineModule` registers the modules of this rank's :class:`PipelineChunk` s at their
paths in the model (the blocks of all its chunks in one ``ModuleDict`` keyed by the original
block index), so ``state_dict()`` and ``named_parameters()`` give the whole model's keys for the part
this rank holds: optimizers, gradient clipping and name-based checkpoints treat it as any other
model, and a checkpoint saved at one ``pp`` loads at another.

Its ``forward(tokens, positions, document_ids, **inputs)`` runs the chunks forward only (the
layout's first-chunk inputs, such as images, read by the first chunk), in global chunk
order (blocking p2p between consecutive chunks on different ranks, a shape header first), and
broadcasts the logits from the rank holding the last chunk to every pipeline rank, so code
written for a whole model (validation loss, greedy sampling) runs unchanged on every rank.
Training does not use it: the schedule drives the chunks (:class:`PipelineSchedule`). The
broadcast costs one logits tensor per forward; evaluation and samples are its only callers.
``loss(logits, targets)`` is computed by the rank holding the head (its TP group is set there)
and broadcast over the pipeline group (the model's extra values are not).

Shared modules (the layout's ``last_shared``, :mod:`mt_parallel.pipeline.split`): when the
first and last chunks are on different ranks, each of the two holds the module, the last
chunk's rank a copy whose parameters are marked ``pipeline_copy = True``. The copy starts as
the first chunk's (:meth:`PipelineModule.sync_shared_parameters`, at construction) and after
every step both gradients become ``g_first + g_last`` (:meth:`reduce_shared_gradients`, one
exchange of a flat buffer between the two ranks; under FSDP2 each side's local shards, which
cover the same elements at the same dp×cp rank): each rank adds the same two tensors, and
IEEE addition is commutative, so the two copies receive equal gradients bit for bit and an
optimizer keeps them equal. A gradient norm counts the copy once (on the first chunk's rank:
:func:`mt_parallel.clip_grad_norm_` skips ``pipeline_copy`` parameters) and checkpoints store
it once. When one rank holds both chunks (``zbv``, ``dualpipev``) there is no copy: both hold
the one module, registered here once, whose gradient accumulates from both backwards (under
FSDP2 it is its own unit, reduced once per step: :mod:`mt_parallel.pipeline.shared_fsdp`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import mt_comm
from mt_parallel.pipeline.split import PipelineChunk, PipelineLayout, place_module

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
_HEADER = 8


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: an FSDP2 shard (the two sides of a shared module are
    sharded alike over the same dp×cp group), else the tensor; writes reach ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class PipelineModule(nn.Module):
    """This rank's chunks under the whole model's names (module docstring)."""

    def __init__(
        self,
        chunks: Sequence[PipelineChunk],
        layout: PipelineLayout,
        stage_ids: Sequence[int],
        placement: dict[int, int],
        pp_ranks: Sequence[int],
        pp_group: Any,
    ) -> None:
        super().__init__()
        for chunk in chunks:
            for path in chunk.held_paths:
                place_module(self, path, chunk.get_submodule(path))
        blocks = nn.ModuleDict()
        for chunk in chunks:
            blocks.update(dict(chunk.get_submodule(layout.blocks).items()))
        place_module(self, layout.blocks, blocks)
        self.pipeline_chunks = list(chunks)
        self.stage_ids, self.placement = list(stage_ids), dict(placement)
        self.pp_ranks, self.pp_group = list(pp_ranks), pp_group
        self.num_stages = len(placement)
        self.pp_rank = self.placement[self.stage_ids[0]]
        self.layout = layout
        first_rank, last_rank = placement[0], placement[self.num_stages - 1]
        self.shared_peer: int | None = None
        """The global rank holding the other side of the shared modules, if not this one."""
        if (
            layout.last_shared
            and first_rank != last_rank
            and self.pp_rank in (first_rank, last_rank)
        ):
            other = last_rank if self.pp_rank == first_rank else first_rank
            self.shared_peer = self.pp_ranks[other]
            if self.pp_rank == last_rank:
                for param in self.shared_parameters():
                    param.pipeline_copy = True  # type: ignore[attr-defined]
            self.sync_shared_parameters()

    def shared_parameters(self) -> list[nn.Parameter]:
        """The parameters of the layout's ``last_shared`` modules, in one order on both ranks."""
        return [
            param
            for path in self.layout.last_shared
            for _, param in sorted(self.get_submodule(path).named_parameters())
        ]

    def _exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """The peer's ``flat`` (the first chunk's rank sends first)."""
        assert self.shared_peer is not None
        received = torch.empty_like(flat)
        if self.pp_rank == self.placement[0]:
            mt_comm.send(flat, self.shared_peer, self.pp_group)
            mt_comm.recv(received, self.shared_peer, self.pp_group)
        else:
            mt_comm.recv(received, self.shared_peer, self.pp_group)
            mt_comm.send(flat, self.shared_peer, self.pp_group)
        return received

    @torch.no_grad()
    def sync_shared_parameters(self) -> None:
        """Copy the first chunk's shared parameters into the last chunk's (module docstring)."""
        if self.shared_peer is None:
            return
        pieces = [_local(p.detach()) for p in self.shared_parameters()]
        received = self._exchange(torch.cat([p.reshape(-1) for p in pieces]))
        if self.pp_rank != self.placement[0]:
            for piece, values in zip(
                pieces, received.split([p.numel() for p in pieces]), strict=True
            ):
                piece.copy_(values.view_as(piece))

    @torch.no_grad()
    def reduce_shared_gradients(self) -> None:
        """Both sides' shared gradients become their sum (module docstring); call after the
        schedule's step on every pipeline rank (a no-op where no shared module is held)."""
        if self.shared_peer is None:
            return
        params = self.shared_parameters()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        pieces = [_local(g) for g in grads]
        received = self._exchange(torch.cat([g.reshape(-1) for g in pieces]))
        for param, grad, piece, other in zip(
            params, grads, pieces, received.split([g.numel() for g in pieces]), strict=True
        ):
            piece.add_(other.view_as(piece))
            param.grad = grad

    @property
    def last_chunk(self) -> PipelineChunk | None:
        return next((c for c in self.pipeline_chunks if c.last), None)

    def _global(self, stage: int) -> int:
        return self.pp_ranks[self.placement[stage]]

    def _send(self, tensor: torch.Tensor, stage: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        mt_comm.send(header, self._global(stage), self.pp_group)
        mt_comm.send(tensor.contiguous(), self._global(stage), self.pp_group)

    def _recv(self, stage: int, device: torch.device) -> torch.Tensor:
        header = mt_comm.recv(
            torch.zeros(_HEADER, dtype=torch.int64, device=device),
            self._global(stage),
            self.pp_group,
        )
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        shape = [int(n) for n in header[2 : 2 + ndim]]
        return mt_comm.recv(
            torch.empty(shape, dtype=dtype, device=device), self._global(stage), self.pp_group
        )

    def _broadcast_from_last(
        self, tensor: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
        if tensor is not None:
            header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
            header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        source = self._global(self.num_stages - 1)
        mt_comm.broadcast(header, source, self.pp_group)
        if tensor is None:
            ndim = int(header[0])
            shape = [int(n) for n in header[2 : 2 + ndim]]
            tensor = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=device)
        return mt_comm.broadcast(tensor.contiguous(), source, self.pp_group)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        **inputs: Any,
    ) -> torch.Tensor:
        chunk_of = dict(zip(self.stage_ids, self.pipeline_chunks, strict=True))
        x: torch.Tensor | None = tokens
        for stage in range(self.num_stages):
            if stage not in chunk_of:
                continue
            if stage > 0 and stage - 1 not in chunk_of:
                x = self._recv(stage - 1, tokens.device)
            assert x is not None
            x = chunk_of[stage](x, positions, document_ids, **inputs)
            if stage + 1 < self.num_stages and stage + 1 not in chunk_of:
                self._send(x, stage + 1)
        holds_last = self.num_stages - 1 in chunk_of
        return self._broadcast_from_last(x if holds_last else None, tokens.device)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss on the head's rank, broadcast over the pipeline (module docstring)."""
        value: torch.Tensor | None = None
        last = self.last_chunk
        if last is not None:
            assert last.loss_fn is not None
            result = last.loss_fn(logits, targets)
            value = (result[0] if isinstance(result, tuple) else result).reshape(())
        return self._broadcast_from_last(value, logits.device)

    def local_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> Any:
        """The model's own loss (with its extras), for the rank holding the head."""
        last = self.last_chunk
        if last is None or last.loss_fn is None:
            raise RuntimeError(f"pipeline rank {self.pp_rank} holds no output head")
        return last.loss_fn(logits, targets)
