"""Alpha-beta communication model: collective times per link tier, and which tier a group uses.

A collective over ``n`` ranks with payload ``S`` bytes (the tensor handed to the collective:
the reduced tensor for all-reduce, the gathered output for all-gather, the input for
reduce-scatter, the sent buffer for all-to-all and p2p) takes, on ring algorithms,

* all-reduce ``2(n−1)·α + 2(n−1)/n · S/β``;
* all-gather, reduce-scatter ``(n−1)·α + (n−1)/n · S/β``;
* all-to-all ``(n−1)·α + (n−1)/n · S/β`` (each rank keeps ``1/n`` of its buffer);
* p2p ``α + S/β``;

with ``α`` the tier's per-step latency of that collective and ``β`` its per-GPU bandwidth.

Tiers. Ranks are laid out as mt-comm's ``ParallelState`` does: tp fastest, then cp, dp, pp; ep
is carved out of dp×cp with ep fastest. A group of ``n`` ranks ``stride`` apart stays inside
one node when ``stride·n ≤ gpus_per_node`` (node-aligned placement, torchrun's default), and
otherwise runs at the inter-node tier, whose NIC bandwidth bounds a ring that crosses nodes.
Not modelled: NCCL's tree and NVLS algorithms, hierarchical (two-tier) collectives, congestion
between groups communicating at the same time, and the SHARP in-network reductions.
"""

from __future__ import annotations

from mt_plan.cluster import Cluster, LinkTier


def ring_factor(collective: str, n: int) -> tuple[float, float]:
    """(latency steps, bandwidth factor) of a ring collective over ``n`` ranks."""
    if n <= 1:
        return 0.0, 0.0
    if collective == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n
    if collective == "p2p":
        return 1.0, 1.0
    raise ValueError(f"unknown collective {collective!r}")


def tier_of(cluster: Cluster, stride: int, size: int) -> LinkTier:
    """The link tier a group of ``size`` ranks ``stride`` apart runs on."""
    if size <= 1 or stride * size <= cluster.gpus_per_node:
        return cluster.intra_node
    return cluster.inter_node


def collective_time(collective: str, payload: float, n: int, tier: LinkTier) -> float:
    """Seconds of one collective (module docstring)."""
    steps, factor = ring_factor(collective, n)
    return steps * tier.alpha(collective) + factor * payload / tier.bandwidth
