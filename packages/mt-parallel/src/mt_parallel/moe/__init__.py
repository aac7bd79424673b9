"""Mixture-of-Experts layers with expert parallelism: router, balancing, capacity, dispatch,
grouped experts, the MoE layer and its load statistics (see each module's docstring)."""

from mt_parallel.moe.balance import (
    bias_update,
    sequence_aux_loss,
    switch_aux_loss,
    update_expert_biases,
)
from mt_parallel.moe.capacity import PermutePlan, expert_capacity, permute, permute_plan, unpermute
from mt_parallel.moe.carry import AuxLossScale, CarryAuxLoss, carry_aux_losses, pipeline_aux_summary
from mt_parallel.moe.config import BALANCING_MODES, DISPATCHERS, SCORE_FUNCTIONS, MoEConfig
from mt_parallel.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher, dispatch_and_combine
from mt_parallel.moe.experts import (
    GroupedExperts,
    GroupedLinear,
    grouped_mm,
    grouped_mm_reason,
    looped_mm,
)
from mt_parallel.moe.layer import (
    MoE,
    apply_expert_parallel,
    collect_aux_losses,
    expert_parameters,
    moe_layers,
    reduce_expert_gradients,
)
from mt_parallel.moe.router import Router, Routing, group_limited_mask
from mt_parallel.moe.stats import LoadStats, global_load_summary, max_violation

__all__ = [
    "BALANCING_MODES",
    "DISPATCHERS",
    "SCORE_FUNCTIONS",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "AuxLossScale",
    "GroupedExperts",
    "GroupedLinear",
    "LoadStats",
    "MoE",
    "MoEConfig",
    "PermutePlan",
    "Router",
    "Routing",
    "CarryAuxLoss",
    "apply_expert_parallel",
    "carry_aux_losses",
    "bias_update",
    "collect_aux_losses",
    "dispatch_and_combine",
    "expert_capacity",
    "expert_parameters",
    "global_load_summary",
    "group_limited_mask",
    "grouped_mm",
    "grouped_mm_reason",
    "looped_mm",
    "max_violation",
    "moe_layers",
    "permute",
    "permute_plan",
    "pipeline_aux_summary",
    "reduce_expert_gradients",
    "sequence_aux_loss",
    "switch_aux_loss",
    "unpermute",
    "update_expert_biases",
]
