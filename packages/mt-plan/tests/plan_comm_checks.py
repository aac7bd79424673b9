"""Run one training step of mt-train and count the bytes each process group is handed
(importable by spawned ``DistributedPool`` workers).

Every collective entry point of ``torch.distributed`` that mt's runtime reaches from Python is
wrapped (and mt-comm's bound single-tensor all-gather / reduce-scatter, and the pipeline
runtime's ``_batch_p2p``, through which every stage send goes, and ring attention's sends);
DDP's C++ reducer is
routed through Python by registering torch's own default all-reduce comm hook, which performs
the same averaging all-reduce per bucket. Payload convention as ``mt_plan.comm``: the reduced
tensor, the gathered output, the scattered input, the sent buffer.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mt_train import Trainer, compose_config, to_train_config


def _nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _ranks(group: Any) -> tuple[int, ...]:
    group = group or dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


def count_one_step(overrides: list[str], output_dir: str | Path) -> dict[str, list]:
    """{"group ranks": [(collective, payload bytes), ...]} of one ``train_step`` on this rank."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.pipelining import schedules
    from torch.nn.parallel import DistributedDataParallel

    import mt_comm.collectives as mtc
    from mt_parallel.ring_attention import _Ring

    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=output_dir)
    if isinstance(trainer.model, DistributedDataParallel):
        trainer.model.register_comm_hook(trainer.model.process_group, default_hooks.allreduce_hook)
    seen: dict[str, list] = defaultdict(list)
    originals: dict[tuple[Any, str], Any] = {}

    def wrap(owner: Any, name: str, payload) -> None:
        original = getattr(owner, name)
        originals[(owner, name)] = original

        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if name == "_batch_p2p":  # the pipeline runtime's p2p: its ops carry the group
                group = args[0][0].group if args[0] else None
            if name == "start":  # ring attention's send to the next cp rank
                group = args[0].group
            seen[str(_ranks(group))].append((name, payload(*args, **kwargs)))
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    first = lambda *a, **k: _nbytes(a[0])  # noqa: E731
    second = lambda *a, **k: _nbytes(a[1])  # noqa: E731
    wrap(dist, "all_reduce", first)
    wrap(dist, "broadcast", first)
    wrap(dist, "all_gather", lambda out, t, **k: _nbytes(out))
    wrap(dist, "reduce_scatter", lambda out, ins, **k: _nbytes(ins))
    wrap(dist, "all_gather_into_tensor", first)
    wrap(dist, "reduce_scatter_tensor", second)
    wrap(dist, "all_to_all_single", second)
    wrap(dist, "send", first)
    wrap(
        schedules,
        "_batch_p2p",
        lambda ops, *a, **k: sum(_nbytes(o.tensor) for o in ops if o.op is dist.isend),
    )
    wrap(_Ring, "start", second)
    wrap(mtc, "_all_gather_single", first)
    wrap(mtc, "_reduce_scatter_single", second)
    try:
        trainer.train_step()
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
        trainer.close()
    return dict(seen)


def local_parameters(overrides: list[str], output_dir: str | Path) -> int:
    """Parameters this rank holds after parallelisation (its tp shard, ep experts, pp stage)."""
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=output_dir)
    try:
        return sum(p.numel() for p in trainer.module.parameters())
    finally:
        trainer.close()
