"""Text output of the planner: the ranked table, the launch line, and ``--explain``'s breakdown."""

from __future__ import annotations

from mt_plan.cluster import Cluster
from mt_plan.cost import Estimate

GIB = 2**30


def table(estimates: list[Estimate], top: int) -> str:
    """The top ``top`` layouts, one row each."""
    head = (
        "| # | layout | step s | tok/s/GPU | MFU | mem GiB | bubble | exposed comm s |\n"
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    rows = [
        f"| {i} | {e.layout.label()} | {e.step_time:.3f} | {e.tokens_per_s_per_gpu:,.0f} | "
        f"{e.mfu:.1%} | {e.peak_memory / GIB:.1f} | {e.bubble_fraction:.1%} | "
        f"{e.exposed_comm:.3f} |"
        for i, e in enumerate(estimates[:top], 1)
    ]
    return "\n".join([head, *rows])


def launch_line(estimate: Estimate, cluster: Cluster, base: list[str], global_batch: int) -> str:
    """The torchrun command that runs ``estimate``'s layout with the user's own overrides."""
    skip = ("parallel.", "fp8=", "trainer.micro_batch_size", "trainer.global_batch_size")
    overrides = [o for o in base if not o.startswith(skip)]
    overrides += estimate.layout.overrides(global_batch)
    world = estimate.layout.world
    if cluster.nodes > 1:
        launcher = (
            f"torchrun --nnodes {cluster.nodes} --nproc-per-node {cluster.gpus_per_node} "
            "--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500"
        )
    else:
        launcher = f"torchrun --standalone --nproc-per-node {world}"
    return f"{launcher} -m mt_train " + " ".join(overrides)


def host_line(e: Estimate) -> str:
    """The host's time per step and whether it bounds the step (``mt_plan.cost``, "Host
    time")."""
    launch, read, source = e.host_costs
    binds = (
        f"the floor binds: +{e.host_floor:.4f} s over the device's time"
        if e.host_floor > 0
        else "the device bounds the step"
    )
    return (
        f"host per step and rank: {e.host_time:.4f} s ({e.kernel_launches:,.0f} kernel launches "
        f"at {launch * 1e6:.1f} us, {e.host_reads} device-to-host reads at {read * 1e6:.1f} us; "
        f"{source} host costs); {binds}"
    )


def explain(e: Estimate) -> str:
    """Where the step time and the memory go for one layout."""
    lines = [f"layout: {e.layout.label()}", f"micro-batches per step and rank: {e.microbatches}"]
    lines.append(
        f"step {e.step_time:.4f} s, {e.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
        f"MFU {e.mfu:.1%}, pipeline bubble {e.bubble_fraction:.1%}, "
        f"{e.roofline_share:.0%} of compute priced by the roofline (uncalibrated)"
    )
    lines += [f"note: {note}" for note in e.notes]
    lines.append(host_line(e))
    lines.append("compute per step and rank (s), by op class:")
    for name, seconds in sorted(e.compute.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<24} {seconds:10.4f}")
    lines.append(
        "communication per step and rank: group, size, tier, payload GiB, time s, exposed s"
    )
    for g in e.comm.values():
        lines.append(
            f"  {g.group:<6} {g.size:>5} {g.tier:<6} {g.payload_bytes / GIB:10.3f} "
            f"{g.seconds:10.4f} {g.exposed:10.4f}"
        )
    lines.append(
        f"optimizer (AdamW, clip norm, FP8 weight requantization): {e.optimizer_time:.4f} s"
    )
    lines.append(
        f"memory of the fullest rank (GiB), {e.peak_memory / GIB:.2f} with allocator overhead:"
    )
    for name, size in e.memory.items():
        lines.append(f"  {name:<24} {size / GIB:10.3f}")
    return "\n".join(lines)
