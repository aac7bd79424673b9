"""Parallel dimensions and the process groups that realise them.

Layout. With degrees ``dp, cp, tp, pp`` and ``world = dp·cp·tp·pp``, global
rank ``r`` has coordinates (``tp`` fastest, then ``cp``, ``dp``, ``pp``, the
Megatron order "tp-cp-dp-pp", which keeps TP groups on neighbouring GPUs of a
node)::

    r = ((pp_i · dp + dp_i) · cp + cp_i) · tp + tp_i

Expert parallelism is carved out of dp×cp, as in Megatron: the combined index
``dc = dp_i · cp + cp_i`` splits as ``dc = edp_i · ep + ep_i`` (``ep`` fastest),
so the ``ep`` ranks of one expert group hold different experts, and the
``edp = dp·cp / ep`` ranks of an expert-data-parallel group hold replicas of
the same experts and reduce their gradients together.

Groups, each rank's coordinate and size per dimension (:data:`DIMENSIONS`):

==========  ==========================================================
``tp``      tensor (and sequence) parallel
``cp``      context parallel
``dp``      data parallel
``pp``      pipeline parallel (``pp_prev_rank`` / ``pp_next_rank``)
``ep``      expert parallel (inside dp×cp)
``edp``     expert data parallel: dp×cp / ep replicas of one expert shard
``dp_cp``   dp×cp: gradients of dense parameters are reduced here
``tp_cp``   tp×cp: ranks that hold pieces of one sequence's activations
``mp``      tp×pp: model parallel (every rank that holds a different shard)
``world``   all ranks
==========  ==========================================================

Every rank calls ``torch.distributed.new_group`` for every group in the same
order (a requirement of torch), then keeps the ones it belongs to. A torch
``DeviceMesh`` over ``(pp, dp, cp, tp)`` is built on first use of
:meth:`ParallelState.device_mesh` for the PyTorch APIs that want one (DTensor,
FSDP2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

DIMENSIONS = ("tp", "cp", "dp", "pp", "ep", "edp", "dp_cp", "tp_cp", "mp", "world")


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees; validated on construction.

    ``world_size`` is the number of processes; ``dp·cp·tp·pp`` must equal it.
    ``ep`` must divide ``dp·cp`` (experts are sharded over data-parallel ranks).
    """

    world_size: int
    dp: int = 1
    """Data-parallel replicas (gradients averaged over dp×cp)."""
    cp: int = 1
    """Context-parallel ranks: the sequence is split across them."""
    tp: int = 1
    """Tensor-parallel ranks: weight matrices are split across them."""
    pp: int = 1
    """Pipeline stages: layers are split across them."""
    ep: int = 1
    """Expert-parallel ranks for MoE layers, carved out of dp×cp."""

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "cp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel degree {name}={value!r} must be a positive integer")
        product = self.dp * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"dp·cp·tp·pp = {self.dp}·{self.cp}·{self.tp}·{self.pp} = {product} must equal "
                f"the world size {self.world_size}"
            )
        if (self.dp * self.cp) % self.ep != 0:
            raise ValueError(
                f"ep={self.ep} must divide dp·cp = {self.dp}·{self.cp} = {self.dp * self.cp} "
                "(expert parallelism is carved out of the data- and context-parallel ranks)"
            )

    @classmethod
    def infer_dp(
        cls, world_size: int, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1
    ) -> ParallelDims:
        """Dims with ``dp = world_size / (cp·tp·pp)``; raises if that is not a whole number."""
        model_parallel = cp * tp * pp
        if model_parallel < 1 or world_size % model_parallel != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by cp·tp·pp = {cp}·{tp}·{pp} = "
                f"{model_parallel}, so dp cannot be inferred"
            )
        return cls(world_size, dp=world_size // model_parallel, cp=cp, tp=tp, pp=pp, ep=ep)

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: dp·cp / ep."""
        return self.dp * self.cp // self.ep

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of global ``rank`` in every dimension of :data:`DIMENSIONS`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")
        tp_i = rank % self.tp
        cp_i = rank // self.tp % self.cp
        dp_i = rank // (self.tp * self.cp) % self.dp
        pp_i = rank // (self.tp * self.cp * self.dp)
        dc = dp_i * self.cp + cp_i
        return {
            "tp": tp_i,
            "cp": cp_i,
            "dp": dp_i,
            "pp": pp_i,
            "ep": dc % self.ep,
            "edp": dc // self.ep,
            "dp_cp": dc,
            "tp_cp": cp_i * self.tp + tp_i,
            "mp": pp_i * self.tp + tp_i,
            "world": rank,
        }

    def group_key(self, rank: int, dim: str) -> tuple[int, ...]:
        """What the ranks of ``rank``'s group in ``dim`` share: the coordinates that stay fixed."""
        c = self.coordinates(rank)
        fixed = {
            "tp": ("pp", "dp", "cp"),
            "cp": ("pp", "dp", "tp"),
            "dp": ("pp", "cp", "tp"),
            "pp": ("dp", "cp", "tp"),
            "ep": ("pp", "tp", "edp"),
            "edp": ("pp", "tp", "ep"),
            "dp_cp": ("pp", "tp"),
            "tp_cp": ("pp", "dp"),
            "mp": ("dp", "cp"),
            "world": (),
        }[dim]
        return tuple(c[name] for name in fixed)

    def group_ranks(self, dim: str) -> list[list[int]]:
        """Every group of ``dim`` as a sorted list of global ranks, ordered by lowest rank."""
        if dim not in DIMENSIONS:
            raise ValueError(f"unknown parallel dimension {dim!r}; known: {', '.join(DIMENSIONS)}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            groups.setdefault(self.group_key(rank, dim), []).append(rank)
        return sorted((sorted(ranks) for ranks in groups.values()), key=lambda ranks: ranks[0])


class ParallelState:
    """This rank's process groups for every parallel dimension.

    Build it with :func:`init_parallel_state` after :func:`mt_comm.init_distributed`.
    In a world of size 1 without a process group every group is ``None`` and
    every size is 1; collective helpers treat ``None`` as "no communication".
    """

    def __init__(self, dims: ParallelDims, rank: int, device_type: str = "cpu") -> None:
        self.dims = dims
        self.global_rank = rank
        self.device_type = device_type
        self._coordinates = dims.coordinates(rank)
        self._ranks: dict[str, list[int]] = {}
        self._groups: dict[str, Any] = {}
        self._mesh: Any = None
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed and dims.world_size != 1:
            raise RuntimeError(
                f"parallel dims need {dims.world_size} processes but torch.distributed is not "
                "initialised; launch with torchrun and call mt_comm.init_distributed() first"
            )
        if distributed and dist.get_world_size() != dims.world_size:
            raise ValueError(
                f"parallel dims are for world size {dims.world_size}, but the process group has "
                f"{dist.get_world_size()} ranks"
            )
        # Dimensions with the same membership share one process group (dp_cp is dp
        # when cp=1); a group of every rank is the default group.
        by_members: dict[tuple[int, ...], Any] = {}
        if distributed:
            by_members[tuple(range(dims.world_size))] = dist.group.WORLD
        for dim in DIMENSIONS:
            for ranks in dims.group_ranks(dim):
                members = tuple(ranks)
                if members not in by_members:
                    # new_group is collective: every rank creates every group, in order.
                    by_members[members] = dist.new_group(ranks) if distributed else None
                if rank in ranks:
                    self._ranks[dim] = ranks
                    self._groups[dim] = by_members[members]

    def _check(self, dim: str) -> None:
        if dim not in DIMENSIONS:
            raise ValueError(f"unknown parallel dimension {dim!r}; known: {', '.join(DIMENSIONS)}")

    def group(self, dim: str) -> Any:
        """This rank's process group in ``dim`` (None without torch.distributed)."""
        self._check(dim)
        return self._groups[dim]

    def rank(self, dim: str) -> int:
        """This rank's coordinate in ``dim`` (its rank inside that group)."""
        self._check(dim)
        return self._coordinates[dim]

    def size(self, dim: str) -> int:
        """The number of ranks in this rank's ``dim`` group."""
        self._check(dim)
        return len(self._ranks[dim])

    def ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's ``dim`` group, ordered by their coordinate in ``dim``."""
        self._check(dim)
        return list(self._ranks[dim])

    # ------------------------------------------------------------- pipeline
    @property
    def is_first_stage(self) -> bool:
        return self.rank("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank("pp") == self.dims.pp - 1

    @property
    def pp_prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self._ranks["pp"][self.rank("pp") - 1]

    @property
    def pp_next_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self._ranks["pp"][self.rank("pp") + 1]

    # ----------------------------------------------------------------- mesh
    def device_mesh(self) -> Any:
        """A torch ``DeviceMesh`` over ``(pp, dp, cp, tp)`` with those dim names (built once)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            d = self.dims
            self._mesh = init_device_mesh(
                self.device_type, (d.pp, d.dp, d.cp, d.tp), mesh_dim_names=("pp", "dp", "cp", "tp")
            )
        return self._mesh

    def __repr__(self) -> str:
        coords = ", ".join(f"{dim}={self.rank(dim)}/{self.size(dim)}" for dim in DIMENSIONS)
        return f"ParallelState(rank={self.global_rank}: {coords})"


_state: ParallelState | None = None


def init_parallel_state(
    dp: int | None = None, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1
) -> ParallelState:
    """Build the process groups for these degrees (``dp=None`` infers it) and keep them.

    Requires :func:`mt_comm.init_distributed` first. Raises if a parallel state
    already exists; call :func:`destroy_parallel_state` to rebuild.
    """
    global _state
    from mt_comm.distributed import init_distributed

    if _state is not None:
        raise RuntimeError(
            f"parallel state already initialised ({_state.dims}); destroy_parallel_state() first"
        )
    context = init_distributed()
    if dp is None:
        dims = ParallelDims.infer_dp(context.world_size, cp=cp, tp=tp, pp=pp, ep=ep)
    else:
        dims = ParallelDims(context.world_size, dp=dp, cp=cp, tp=tp, pp=pp, ep=ep)
    _state = ParallelState(dims, context.rank, context.device.type)
    return _state


def get_parallel_state() -> ParallelState:
    """The state built by :func:`init_parallel_state`; raises if there is none."""
    if _state is None:
        raise RuntimeError("init_parallel_state() has not been called in this process")
    return _state


def destroy_parallel_state() -> None:
    """Destroy this module's process groups (not the default group) and forget the state."""
    global _state
    if _state is not None and dist.is_initialized():
        destroyed: set[int] = set()
        for group in _state._groups.values():
            if group is not None and group is not dist.group.WORLD and id(group) not in destroyed:
                destroyed.add(id(group))
                dist.destroy_process_group(group)
    _state = None
