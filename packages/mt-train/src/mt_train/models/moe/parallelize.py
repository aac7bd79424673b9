"""The MoE family's parallelize plan: Llama's (DecoderBlock blocks, ``output`` head).

Expert parallelism needs nothing in the plan: :func:`mt_parallel.parallelize` finds the MoE
layers themselves (:func:`mt_parallel.moe.apply_expert_parallel`); the router is not a TP
linear, so it never runs in FP8.
"""

from __future__ import annotations

from mt_parallel import ParallelizePlan
from mt_train.models.llama.parallelize import PLAN
from mt_train.models.moe.config import MoEModelConfig


def moe_plan(cfg: MoEModelConfig) -> ParallelizePlan:
    """The same plan for every MoE size."""
    return PLAN
