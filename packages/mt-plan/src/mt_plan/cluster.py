"""Cluster descriptions: GPU kind, node shape and the two link tiers, validated on load.

A cluster is ``nodes`` nodes of ``gpus_per_node`` GPUs. Every GPU has a dense peak (bf16 and FP8
FLOP/s), a memory capacity and a copy bandwidth; links come in two tiers, ``intra_node``
(NVLink: every GPU pair of a node) and ``inter_node`` (the NICs: ``bandwidth`` is what one GPU
can send to another node). Each tier has an alpha-beta model per collective: a collective over
``n`` ranks moving ``bytes`` takes ``steps(n)·latency + factor(n)·bytes / bandwidth`` (the
factors are in :mod:`mt_plan.comm`). A collective whose group spans nodes runs at the
inter-node tier (the slowest link bounds a ring).

The shipped descriptions live in ``mt_plan/data/clusters/`` as JSON (``h200`` one H200,
``h200_nodes`` 8×H200 nodes with NVLink and 8×400 Gb/s NICs); ``--cluster FILE`` reads any
other, and ``--nodes``/``--gpus-per-node`` edit the node count and shape. Values are the
datasheets' unless the file's ``source`` says they were measured.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


class ClusterError(ValueError):
    """A cluster description that cannot describe a machine (the message names the value)."""


@dataclass(frozen=True)
class LinkTier:
    """One link tier: per-GPU bandwidth (bytes/s) and per-step latency (s) of each collective."""

    bandwidth: float
    latency: float
    collective_latency: dict[str, float] = field(default_factory=dict)
    """Per-collective latency overrides (seconds per algorithm step); missing ones use
    ``latency``."""

    def alpha(self, collective: str) -> float:
        return self.collective_latency.get(collective, self.latency)


@dataclass(frozen=True)
class GPU:
    """One accelerator's datasheet numbers."""

    name: str
    memory_bytes: float
    peak_bf16_flops: float
    peak_fp8_flops: float
    memory_bandwidth: float
    """Bytes/s of device memory (the roofline's memory roof)."""
    mx_fp8: bool = False
    """Whether MXFP8 (1×32 E8M0 scales) runs on tensor cores (Blackwell); otherwise mt emulates
    it through bf16 GEMMs and the planner prices it as bf16."""


@dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``gpus_per_node`` GPUs of one kind and the two link tiers."""

    name: str
    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra_node: LinkTier
    inter_node: LinkTier
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "nodes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ClusterError(
                    f"cluster {self.name!r}: {key}={value!r} must be a positive integer "
                    "(a cluster needs at least one GPU)"
                )
        for key in ("memory_bytes", "peak_bf16_flops", "peak_fp8_flops", "memory_bandwidth"):
            if not getattr(self.gpu, key) > 0:
                raise ClusterError(
                    f"cluster {self.name!r}: gpu.{key}={getattr(self.gpu, key)!r} must be > 0"
                )
        for tier_name in ("intra_node", "inter_node"):
            tier = getattr(self, tier_name)
            if not tier.bandwidth > 0 or tier.latency < 0:
                raise ClusterError(
                    f"cluster {self.name!r}: {tier_name} needs bandwidth > 0 and latency >= 0, "
                    f"got bandwidth={tier.bandwidth!r}, latency={tier.latency!r}"
                )
            unknown = sorted(set(tier.collective_latency) - set(COLLECTIVES))
            if unknown:
                raise ClusterError(
                    f"cluster {self.name!r}: {tier_name}.collective_latency has {unknown}; "
                    f"valid: {', '.join(COLLECTIVES)}"
                )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def with_gpus(self, gpus: int) -> Cluster:
        """The same kind of cluster with ``gpus`` GPUs: one partial node when ``gpus`` fits a
        node, else whole nodes (refused when ``gpus`` is not a multiple of the node size)."""
        if not isinstance(gpus, int) or gpus < 1:
            raise ClusterError(f"--gpus={gpus!r} must be a positive integer")
        if gpus <= self.gpus_per_node:
            return replace(self, gpus_per_node=gpus, nodes=1)
        if gpus % self.gpus_per_node:
            raise ClusterError(
                f"--gpus={gpus} is not a multiple of gpus_per_node={self.gpus_per_node} "
                f"(whole nodes: {self.gpus_per_node * (gpus // self.gpus_per_node)} or "
                f"{self.gpus_per_node * (gpus // self.gpus_per_node + 1)})"
            )
        return replace(self, nodes=gpus // self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cluster_from_dict(data: dict[str, Any]) -> Cluster:
    """A :class:`Cluster` from its JSON form; missing or unknown keys are named."""
    name = data.get("name", "<unnamed>")
    try:
        gpu = GPU(**data["gpu"])
        tiers = {k: LinkTier(**data[k]) for k in ("intra_node", "inter_node")}
        return Cluster(
            name=name,
            gpu=gpu,
            gpus_per_node=data["gpus_per_node"],
            nodes=data["nodes"],
            source=data.get("source", ""),
            **tiers,
        )
    except KeyError as missing:
        raise ClusterError(f"cluster {name!r}: missing key {missing}") from None
    except TypeError as error:
        raise ClusterError(f"cluster {name!r}: {error}") from None


def shipped_clusters() -> list[str]:
    """Names of the cluster descriptions that ship with mt-plan."""
    folder = resources.files("mt_plan") / "data" / "clusters"
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def load_cluster(name_or_path: str) -> Cluster:
    """A shipped cluster by name (``h200``, ``h200_nodes``) or a JSON file by path."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ClusterError(f"cluster file {name_or_path} does not exist")
        return cluster_from_dict(json.loads(path.read_text()))
    if name_or_path not in shipped_clusters():
        raise ClusterError(
            f"unknown cluster {name_or_path!r}; shipped: {', '.join(shipped_clusters())}, "
            "or a path to a JSON file"
        )
    text = (resources.files("mt_plan") / "data" / "clusters" / f"{name_or_path}.json").read_text()
    return cluster_from_dict(json.loads(text))


def edit_cluster(
    cluster: Cluster, nodes: int | None = None, gpus_per_node: int | None = None
) -> Cluster:
    """``cluster`` with its node count and node size replaced where given (validated)."""
    changes: dict[str, Any] = {}
    if nodes is not None:
        changes["nodes"] = nodes
    if gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
    return replace(cluster, **changes) if changes else cluster
