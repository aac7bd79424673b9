"""TP-degree-independent initialisation, and splitting / merging full state dicts into TP pieces.

Initialisation: :func:`init_weights` gives every module that has ``reset_parameters(generator)``
its own CPU generator seeded from ``(seed, module name)`` (crc32 of the name, so the seed does not
depend on construction order, Python's hash seed or the device). The TP layers draw the *full*
matrix from it and keep their slice, so tp=1 and tp=4 start from the same full weights, and a GPU
model starts from the same weights as a CPU one.

State dicts: :func:`tp_shard_plan` maps every TP-sharded entry of ``model.state_dict()`` to its
split dimension (read off the layers' ``tp_shard_dims``); everything else is replicated.
:func:`shard_state_dict` cuts a full (tp=1) state dict into rank ``r``'s piece (contiguous
slices in rank order, the layout the layers use) and :func:`merge_state_dicts` concatenates the
pieces back. ``merge(shard(sd, r) for r) == sd`` exactly; checkpoints and Hugging Face import
go through these.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from mt_parallel.layers import TensorParallelModule


def layer_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of module ``name`` for base ``seed``."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def init_weights(model: nn.Module, seed: int) -> None:
    """Re-initialise every module with a ``reset_parameters(generator)`` (module docstring)."""
    for name, module in model.named_modules():
        reset = getattr(module, "reset_parameters", None)
        if reset is not None and "generator" in inspect.signature(reset).parameters:
            reset(generator=layer_generator(seed, name))


def tp_shard_plan(model: nn.Module) -> dict[str, int]:
    """``state_dict`` key -> dimension split over TP, for every TP-sharded entry of ``model``."""
    plan: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, TensorParallelModule):
            prefix = f"{name}." if name else ""
            for param, dim in module.tp_shard_dims.items():
                if getattr(module, param, None) is not None:
                    plan[prefix + param] = dim
    return plan


def shard_state_dict(
    full: Mapping[str, torch.Tensor], plan: Mapping[str, int], tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """Rank ``tp_rank``'s piece of a full state dict (replicated entries are shared, not copied)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in full.items():
        dim = plan.get(key)
        if dim is None:
            out[key] = tensor
            continue
        if tensor.shape[dim] % tp_size:
            raise ValueError(
                f"{key}: dimension {dim} of size {tensor.shape[dim]} is not divisible by "
                f"tp={tp_size}"
            )
        out[key] = tensor.chunk(tp_size, dim=dim)[tp_rank].clone()
    return out


def merge_state_dicts(
    pieces: Sequence[Mapping[str, torch.Tensor]], plan: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """The full state dict from every TP rank's piece (in TP rank order)."""
    if not pieces:
        raise ValueError("merge_state_dicts needs at least one piece")
    keys = list(pieces[0])
    for rank, piece in enumerate(pieces):
        if list(piece) != keys:
            raise ValueError(f"TP piece {rank} has different keys than piece 0")
    return {
        key: torch.cat([p[key] for p in pieces], dim=plan[key]) if key in plan else pieces[0][key]
        for key in keys
    }
