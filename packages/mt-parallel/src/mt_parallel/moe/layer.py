"""The MoE feed-forward layer: router → dispatch → grouped experts → combine (+ shared experts).

Shape suffixes: B batch, S sequence (this rank's), T = B·S, D width, K top-k.

Math::

    routing = router(m_BSD)                               (mt_parallel.moe.router)
    y_t = Σ_j w_tj · Expert_{idx_tj}(m_t)   over kept assignments (capacity)
        + SharedMLP(m_t)                    when n_shared_experts > 0

Order. With ``shared_expert_overlap`` (the default) and the all-to-all dispatcher over
``ep > 1`` ranks, ``SharedMLP(m)`` runs inside the dispatch, after the ``P×L`` expert counts
are exchanged and their copy to the host is queued, and before the host reads them
(:mod:`~mt_parallel.moe.dispatch`): on an accelerator the device computes the shared experts
while the host waits for the counts and then queues the row all-to-all (Megatron-Core's
``moe_shared_expert_overlap``). Otherwise (switched off, ``ep = 1``, the all-gather dispatcher)
they run after the routed part. Each part computes the same values in either order, and the
backward adds the three terms of ``m``'s gradient (shared, routed, router) in the same order
(the shared experts' backward still runs before the permutation's): output and every gradient
are bit-identical.

``SharedMLP`` is one :class:`~mt_parallel.MLP` of width ``n_shared·shared_ffn_dim`` (the sum of
the shared experts, exactly: SwiGLU experts side by side are one wider SwiGLU), TP-sharded like
any MLP. The routed experts are not TP-sharded: under ``tp > 1`` without sequence parallel
every TP rank computes the same tokens' experts (tokens are replicated over TP), and their ep
groups are separate.

Sequence parallel (Megatron-Core's layout with expert-tensor-parallel size 1): ``m`` is this
TP rank's S/tp tokens of each sequence. The router and the routed experts (replicated over
TP) act on those tokens only, with no gather, and the routed output stays sequence-sharded;
their weights' gradients are summed over TP (:mod:`~mt_parallel.moe.router`,
:mod:`~mt_parallel.moe.experts`: for experts split over ep once per step with their
expert-data-parallel reduction, in every data-parallel mode; at ep = 1 in each micro-batch's
backward).
The shared experts are an SP MLP
(all-gather of ``m`` along the sequence, column/row parallel, reduce-scatter back). The
load-balancing statistics are those of the whole TP region, as without SP: expert counts (aux
loss, aux-loss-free bias, :class:`LoadStats`) and probability means (aux and sequence-aux
losses, z-loss) are summed over TP, and the dropped fraction too. Capacity
(``capacity_factor``) is counted per rank on its own S/tp tokens, ``C = ceil(c·(B·S/tp)·K/E)``,
as Megatron-Core does: with a capacity the kept assignments can differ from the layer without
SP (an expert overloaded on one rank's shard and idle on another's drops there); dropless
routing is exact. With ``ep > 1`` each TP
rank dispatches its own tokens over its ep group (the ep groups are carved from dp×cp, one per
TP rank, as without SP).

Auxiliary losses. The layer keeps its last forward's weighted auxiliary and z-losses in
:attr:`MoE.aux_losses` (with graph) and its :class:`~mt_parallel.moe.stats.LoadStats`; the
model adds the losses to the training loss (:func:`collect_aux_losses`), so their gradients
reach the router through the normal backward (also under recompute and pipelines). A forward
recomputed inside backward does not overwrite them.

Expert parallelism is applied by :func:`apply_expert_parallel` (step 1 of
:func:`mt_parallel.parallelize`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import mt_comm
from mt_parallel.data_parallel import REDUCED_BY_OPTIMIZER, is_expert_parameter
from mt_parallel.layers import scaled_init_std
from mt_parallel.mappings import group_size
from mt_parallel.mlp import MLP
from mt_parallel.moe.config import MoEConfig
from mt_parallel.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher, dispatch_and_combine
from mt_parallel.moe.experts import GroupedExperts
from mt_parallel.moe.router import Router
from mt_parallel.moe.stats import LoadStats, summarize


class MoE(nn.Module):
    """``forward(m_BSD) -> y_BSD`` (module docstring); a drop-in for :class:`~mt_parallel.MLP`."""

    def __init__(
        self, dim: int, cfg: MoEConfig, num_layers: int = 1, init_std: float = 0.02,
        scaled_residual_init: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.cfg, self.dim = cfg, dim
        out_std = scaled_init_std(init_std, num_layers) if scaled_residual_init else init_std
        self.router = Router(dim, cfg, init_std)
        self.experts = GroupedExperts(cfg.num_experts, dim, cfg.expert_ffn_dim, init_std, out_std)
        self.shared_experts: MLP | None = None
        if cfg.n_shared_experts > 0:
            self.shared_experts = MLP(dim, cfg.shared_hidden_dim, num_layers, init_std)
            self.shared_experts.down_proj.init_std = out_std
        self.ep_group: Any = None
        self.sequence_group: Any = None
        """The TP group under sequence parallel (its ranks hold different tokens), else None."""
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.load_stats: LoadStats | None = None

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        """Under SP the routed part runs on this rank's tokens (module docstring); the router's
        and experts' own hooks sum their gradients and statistics over TP."""
        self.sequence_group = tp_group if sequence_parallel else None

    def _dispatcher(self) -> AllToAllDispatcher | AllGatherDispatcher:
        if self.cfg.dispatcher == "all_gather":
            return AllGatherDispatcher(self.cfg.num_experts, self.ep_group)
        return AllToAllDispatcher(self.cfg.num_experts, self.ep_group)

    def forward(self, m_BSD: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = m_BSD.shape
        routing = self.router(m_BSD)
        x_TD = m_BSD.reshape(batch * seq, dim)
        shared_BSD: torch.Tensor | None = None

        def run_shared_experts() -> None:
            nonlocal shared_BSD
            shared_BSD = self.shared_experts(m_BSD)

        overlap = self.shared_experts is not None and self.cfg.shared_expert_overlap
        y_TD, dropped = dispatch_and_combine(
            self._dispatcher(), x_TD, routing.indices_TK, routing.weights_TK,
            self.experts, self.cfg.capacity_factor, self.cfg.pad_to_capacity,
            while_counts_travel=run_shared_experts if overlap else None,
            padded_layout=self.experts.padded_layout,
        )  # fmt: skip
        if torch._C._current_graph_task_id() == -1:  # not a recomputation in backward
            self.aux_losses = {"moe_aux_loss": routing.aux_loss, "moe_z_loss": routing.z_loss}
            assignments = routing.indices_TK.numel() * group_size(self.sequence_group)
            if not isinstance(dropped, torch.Tensor):  # dropless: no host-to-device copy
                dropped = m_BSD.new_zeros((), dtype=torch.int64)
            if self.cfg.capacity_factor is not None and group_size(self.sequence_group) > 1:
                dropped = mt_comm.all_reduce(dropped.clone(), group=self.sequence_group)
            fraction = dropped.float() / assignments
            self.load_stats = LoadStats(routing.counts_E.detach(), fraction.detach())
        y_BSD = y_TD.view(batch, seq, dim)
        if self.shared_experts is not None:
            if shared_BSD is None:  # no count exchange to hide them behind (or overlap off)
                run_shared_experts()
            y_BSD = y_BSD + shared_BSD
        return y_BSD


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def collect_aux_losses(model: nn.Module) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The sum of every MoE layer's last auxiliary losses (None for a dense model) and the
    values to log: each loss summed over layers (detached) and :func:`stats.summarize`. The
    layers' references are released, so the graph is not kept past the backward."""
    layers = moe_layers(model)
    if not layers:
        return None, {}
    sums: dict[str, torch.Tensor] = {}
    for layer in layers:
        for name, value in layer.aux_losses.items():
            sums[name] = sums[name] + value if name in sums else value
        layer.aux_losses = {}
    total = sum(sums.values()) if sums else None
    logged = {name: value.detach() for name, value in sums.items()}
    logged.update(summarize([layer.load_stats for layer in layers if layer.load_stats is not None]))
    return total, logged


def apply_expert_parallel(
    model: nn.Module, ep_group: Any, edp_group: Any, dp_cp_group: Any
) -> nn.Module:
    """Split every MoE layer's routed experts over ``ep_group`` (ep rank ``r`` keeps experts
    ``[r·E/ep, (r+1)·E/ep)``), mark them for gradient reduction over ``edp_group`` and give the
    routers ``dp_cp_group`` for the global token counts of the aux-loss-free bias."""
    dp_cp_size = group_size(dp_cp_group)
    for layer in moe_layers(model):
        layer.router.count_group = dp_cp_group
        if group_size(ep_group) > 1:
            layer.cfg.check_expert_parallel(group_size(ep_group))
            for proj in (layer.experts.gate_proj, layer.experts.up_proj, layer.experts.down_proj):
                proj.shard_experts_(ep_group, edp_group, dp_cp_size)
            layer.ep_group = ep_group
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters (split over ep; their gradients skip DDP)."""
    return [p for p in model.parameters() if is_expert_parameter(p)]


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module) -> None:
    """Sum expert gradients over their expert-data-parallel group (and, under sequence
    parallel, over TP) and divide by dp×cp; every data-parallel mode calls this once, after
    the last micro-batch's backward.

    Each expert's gradient on an ep rank already sums the contributions of every token the ep
    group routed to it (the all-to-all's backward brings them back); the gradient of the global
    mean loss sums that over the edp replicas and divides by the dp×cp ranks whose mean losses
    are averaged (module docstring of :mod:`mt_parallel.data_parallel`). Under sequence
    parallel each TP rank's ep group routed other tokens, so the TP ranks' sums are added too
    (the weight's ``expert_sequence_group``; :mod:`mt_parallel.moe.experts`). Experts FSDP2
    shards (DTensor parameters) arrive reduce-scattered over edp and divided: only the TP sum
    is left, done on this rank's shard. Experts ZeRO-1 reduces (marked
    :data:`~mt_parallel.data_parallel.REDUCED_BY_OPTIMIZER`) are left to its step, which sums
    over TP too.
    """
    params = [p for p in expert_parameters(model) if p.grad is not None]
    params = [p for p in params if not getattr(p, REDUCED_BY_OPTIMIZER, False)]
    whole = [p for p in params if not isinstance(p, DTensor)]
    if whole:
        groups = (whole[0].expert_data_group, whole[0].expert_sequence_group)
        _sum_in_place([p.grad for p in whole], groups, whole[0].expert_grad_divisor)
    sharded = [p for p in params if isinstance(p, DTensor)]
    if sharded:
        _sum_in_place([p.grad.to_local() for p in sharded], (sharded[0].expert_sequence_group,))


def _sum_in_place(grads: list[torch.Tensor], groups: tuple[Any, ...], divisor: int = 1) -> None:
    """Sum ``grads`` over each of ``groups`` (one flat all-reduce per group of more than one
    rank), divide by ``divisor`` and write the results back into them."""
    groups = tuple(g for g in groups if group_size(g) > 1)
    if not groups and divisor == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    for group in groups:
        mt_comm.all_reduce(flat, group=group)
    flat.div_(divisor)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
