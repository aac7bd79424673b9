"""mt-comm: collective backends as plugins, distributed init, parallel groups, collectives."""

from mt_comm.backend import (
    CollectiveBackend,
    ensure_builtin_backends,
    get_backend,
    list_backends,
    select_backend,
)
from mt_comm.collectives import (
    FP8_DTYPES,
    PendingReduce,
    all_gather,
    all_reduce,
    all_reduce_start,
    all_to_all,
    batch_send_recv,
    broadcast,
    group_rank,
    group_size,
    is_fp8,
    recv,
    reduce_scatter,
    send,
)
from mt_comm.distributed import (
    DistributedContext,
    destroy_distributed,
    get_distributed_context,
    init_distributed,
    launched_by_torchrun,
)
from mt_comm.parallel_state import (
    DIMENSIONS,
    ParallelDims,
    ParallelState,
    destroy_parallel_state,
    get_parallel_state,
    init_parallel_state,
)

__version__ = "0.1.0"

__all__ = [
    "DIMENSIONS",
    "FP8_DTYPES",
    "CollectiveBackend",
    "DistributedContext",
    "ParallelDims",
    "ParallelState",
    "PendingReduce",
    "__version__",
    "all_gather",
    "all_reduce",
    "all_reduce_start",
    "all_to_all",
    "batch_send_recv",
    "broadcast",
    "destroy_distributed",
    "destroy_parallel_state",
    "ensure_builtin_backends",
    "get_backend",
    "get_distributed_context",
    "get_parallel_state",
    "group_rank",
    "group_size",
    "init_distributed",
    "init_parallel_state",
    "is_fp8",
    "launched_by_torchrun",
    "list_backends",
    "recv",
    "reduce_scatter",
    "select_backend",
    "send",
]
