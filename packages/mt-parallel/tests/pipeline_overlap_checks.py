"""Per-rank checks of DualPipeV's overlap function (:mod:`mt_parallel.pipeline.overlap`), run on
4 gloo ranks by test_pipeline_overlap_world4.py: pp=2 × dp=2 with the experts split over ep=2.

Each rank builds the toy MoE LM twice from one seed and runs one DualPipeV step over the same
micro-batches from the same generator state, once with the overlap function and once with
torch's halves back to back, and compares the losses, every gradient, the MoE records and the
generators' final state bit for bit. Both runs are traced: every ``all_to_all_single`` (started,
waited for, or blocking) and the start of every block's and expert MLP's forward and backward,
each event labelled forward or backward, in the order they happen on the rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from parallel_checks import _batch, _lm
from pipeline_checks import BATCH, MOE, SEQ
from toy_lm import PLAN

import mt_comm
import mt_parallel as mp
from mt_parallel.pipeline import StageShapes
from mt_parallel.pipeline.schedules import OVERLAP

Event = tuple[str, str, int]
"""``(what, half, id)``: ``start``/``wait``/``blocking`` of an all-to-all ``id``, or
``compute`` (a block or expert MLP starting its forward or backward); half ``F`` or ``B``."""


class _TracedWork:
    def __init__(self, work: dist.Work, events: list[Event], half: str, ident: int) -> None:
        self._work, self._events, self._half, self._id = work, events, half, ident

    def wait(self) -> bool:
        done = self._work.wait()
        self._events.append(("wait", self._half, self._id))
        return done


def _half() -> str:
    """Backward inside an autograd graph task (a recomputation included), else forward."""
    return "F" if torch._C._current_graph_task_id() == -1 else "B"


@contextlib.contextmanager
def _trace(chunks: list[torch.nn.Module]) -> Iterator[list[Event]]:
    events: list[Event] = []
    original = dist.all_to_all_single

    def all_to_all_single(*args, async_op: bool = False, **kwargs):
        ident, half = len(events), _half()
        work = original(*args, async_op=async_op, **kwargs)
        if not async_op:
            events.append(("blocking", half, ident))
            return work
        events.append(("start", half, ident))
        return _TracedWork(work, events, half, ident)

    def forward_starts(module, args) -> None:
        events.append(("compute", "F", -1))

    def backward_starts(module, args, output) -> None:
        if output.requires_grad:
            output.register_hook(lambda grad: events.append(("compute", "B", -1)))

    hooks = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, mp.DecoderBlock | mp.moe.GroupedExperts):
                hooks.append(module.register_forward_pre_hook(forward_starts))
                hooks.append(module.register_forward_hook(backward_starts))
    dist.all_to_all_single = all_to_all_single
    try:
        yield events
    finally:
        dist.all_to_all_single = original
        for hook in hooks:
            hook.remove()


def _overlapped(events: list[Event]) -> dict[str, list[int]]:
    """Per half: ``[all-to-alls started asynchronously, those during which the other half
    started computing]``."""
    counts = {"F": [0, 0], "B": [0, 0]}
    for i, (what, half, ident) in enumerate(events):
        if what != "start":
            continue
        end = events.index(("wait", half, ident), i)
        other = any(e[0] == "compute" and e[1] != half for e in events[i + 1 : end])
        counts[half][0] += 1
        counts[half][1] += other
    return counts


def dualpipev_overlap(
    microbatches: int = 4, dropout: float = 0.0, recompute: str = "none", seed: int = 0
) -> dict[str, object]:
    """One DualPipeV step with and without the overlap function (module docstring)."""
    state = mt_comm.init_parallel_state(dp=2, pp=2, ep=2)
    config = mp.ParallelConfig(
        dp=2, pp=2, ep=2, data_parallel="none", recompute=recompute, pp_schedule="dualpipev",
        pp_microbatches=microbatches,
    )  # fmt: skip
    tokens, targets = _batch(seed + 1 + state.rank("dp"), microbatches * BATCH, SEQ)
    tokens, targets = tokens.split(BATCH), targets.split(BATCH)
    runs = {}
    for overlap in (True, False):
        model = _lm(layers=4, moe=MOE, dropout=dropout)
        mp.init_weights(model, seed)
        chunks = mp.pipeline_chunks(model, config, state, PLAN)
        dim, vocab = model.embed.weight.shape[1], model.lm_head.weight.shape[0]
        shapes = StageShapes(
            tokens=((BATCH, SEQ), torch.long),
            hidden=((BATCH, SEQ, dim), torch.float32),
            logits=((BATCH, SEQ, vocab), torch.float32),
        )
        runner = mp.PipelineSchedule(
            chunks, "dualpipev", 2, state.rank("pp"), microbatches, 1, shapes,
            torch.device("cpu"), state.group("pp"), model.loss, overlap=overlap,
        )  # fmt: skip
        torch.manual_seed(seed + 7)  # the dropout masks of both runs start alike
        with _trace(chunks) as events:
            result = runner.step(list(tokens), list(targets))
        runs[overlap] = {
            "overlaps": runner.overlaps,
            "losses": torch.stack(result.losses) if result.losses else None,
            "grads": {n: p.grad for c in chunks for n, p in c.named_parameters()},
            "records": [dict(c.aux_records) for c in chunks],
            "rng": torch.get_rng_state(),
            "events": events,
            "pairs": sum(a.computation_type == OVERLAP for a in runner.actions[state.rank("pp")]),
        }
    on, off = runs[True], runs[False]
    same_losses = (on["losses"] is None and off["losses"] is None) or torch.equal(
        on["losses"], off["losses"]
    )
    return {
        "overlaps": (on["overlaps"], off["overlaps"]),
        "pairs": on["pairs"],
        "losses_equal": same_losses,
        "holds_last": on["losses"] is not None,
        "grads_differing": sorted(
            n for n, g in on["grads"].items() if g is None or not torch.equal(g, off["grads"][n])
        ),
        "grad_count": len(on["grads"]),
        "records_equal": all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            for a, b in zip(on["records"], off["records"], strict=True)
        ),
        "rng_equal": torch.equal(on["rng"], off["rng"]),
        "overlapped": _overlapped(on["events"]),
        "back_to_back": _overlapped(off["events"]),
    }
