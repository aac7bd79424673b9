"""The Llama family's parallelize plan: what :func:`mt_parallel.parallelize` needs to know.

The blocks are mt_parallel's :class:`~mt_parallel.DecoderBlock` (the unit of full recompute,
compile and FSDP2 sharding); the logits GEMM is ``output`` (high precision unless
``fp8.output_head``); under pipeline parallelism ``embed`` runs on the first chunk and
``norm`` then ``output`` on the last. Everything else (which projections share an input, which module is the
attention core) is declared by mt_parallel's layers themselves.
"""

from __future__ import annotations

import mt_parallel
from mt_train.models.llama.config import LlamaConfig

PLAN = mt_parallel.ParallelizePlan(
    block_types=(mt_parallel.DecoderBlock,),
    output_head="output",
    pipeline=mt_parallel.PipelineLayout("embed", "layers", ("norm", "output")),
)


def llama_plan(cfg: LlamaConfig) -> mt_parallel.ParallelizePlan:
    """The same plan for every Llama size."""
    return PLAN
