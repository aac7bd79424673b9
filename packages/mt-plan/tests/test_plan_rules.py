"""The planner's mirror of the trainer's layout rules gives the trainer's verdict.

For a grid of layouts on several families and world sizes, :func:`mt_plan.layout_problem`
must say "runs" exactly when mt-train's own checks accept the layout (both context-parallel
attentions; the ring refuses dropout): composing the ``TrainConfig`` (``ParallelConfig`` and
the family's ``check_parallel``), ``check_world`` and mt-comm's ``ParallelDims`` (ep inside
dp×cp). Explicit pipeline splits (``pp_layers``) get the
trainer's verdict and its very message, and the planner's torch-free ``split_layers`` gives
mt-parallel's counts and messages on every case of a grid.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from mt_plan.layout import Layout, layout_problem
from mt_plan.models import resolve, shape_of

MODELS = {
    # debug Llama with 6 layers: pp up to 6 chunks, heads 4 / KV 2, vocabulary 320
    "llama": ["model=debug", "model.n_layers=6", "model.vocab_size=320"],
    "moe": ["model=mixtral_tiny", "model.vocab_size=320"],
    "deepseek_v3": ["model=deepseek_v3_tiny", "model.vocab_size=320", "model.mtp_depth=0"],
    "deepseek_v3_mtp": ["model=deepseek_v3_tiny", "model.vocab_size=320", "model.mtp_depth=1"],
    "vlm": ["model=vlm_tiny", "model.vocab_size=320"],
}
SEQ, GLOBAL_BATCH = 24, 8


def trainer_verdict(base, layout: Layout, world: int) -> bool:
    """Whether mt-train's own checks accept ``layout`` at ``world`` ranks."""
    return trainer_problem(base, layout, world) is None


def trainer_problem(base, layout: Layout, world: int) -> str | None:
    """mt-train's message refusing ``layout`` at ``world`` ranks, or None when it runs it."""
    from mt_comm.parallel_state import ParallelDims
    from mt_parallel import ParallelConfig
    from mt_train.config import TrainConfig

    targets = ["attention", "mlp"] if layout.recompute == "selective_mlp" else ["attention"]
    try:
        parallel = ParallelConfig(
            tp=layout.tp, cp=layout.cp, cp_attention=layout.cp_attention, pp=layout.pp,
            ep=layout.ep,
            sequence_parallel=layout.sp, pp_schedule=layout.schedule,
            pp_chunks=layout.vpp, data_parallel=layout.dp_mode,
            recompute={"selective_mlp": "selective", "full_keep": "full"}.get(
                layout.recompute, layout.recompute),
            recompute_targets=targets,
            recompute_keep=["attention"] if layout.recompute == "full_keep" else [],
            recompute_every=layout.recompute_every, pp_layers=list(layout.pp_layers),
        )  # fmt: skip
        trainer = dataclasses.replace(
            base.trainer, seq_len=SEQ, global_batch_size=GLOBAL_BATCH,
            micro_batch_size=layout.micro_batch,
        )  # fmt: skip
        config = TrainConfig(
            model=base.model, parallel=parallel, fp8=base.fp8, optimizer=base.optimizer,
            scheduler=base.scheduler, data=base.data, checkpoint=base.checkpoint,
            rewind=base.rewind, fault=base.fault, logging=base.logging,
            profiling=base.profiling, comm=base.comm, trainer=trainer,
        )  # fmt: skip
        dp = config.check_world(world)
        ParallelDims(world, dp=dp, cp=layout.cp, tp=layout.tp, pp=layout.pp, ep=layout.ep)
    except ValueError as error:
        return str(error)
    return None


def grid(world: int):
    for tp, cp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2, 3, 4)):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        for cp_attention, sp, ep, mb, (schedule, vpp), mode, rc in itertools.product(
            ("all_gather", "ring") if cp > 1 else ("all_gather",), (False, True), (1, 2, 4),
            (1, 2, 4),
            [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
             ("zero_bubble", 2), ("zbv", 1), ("dualpipev", 1)] if pp > 1 else [("1f1b", 1)],
            ("ddp", "fsdp", "zero1"), ("none", "full_keep"),
        ):  # fmt: skip
            yield Layout(tp=tp, cp=cp, cp_attention=cp_attention, pp=pp, dp=dp, ep=ep, sp=sp,
                         vpp=vpp, schedule=schedule, dp_mode=mode, micro_batch=mb,
                         recompute=rc)  # fmt: skip


@pytest.mark.parametrize("family", sorted(MODELS))
def test_mirror_agrees_with_the_trainer(family: str) -> None:
    base = resolve([*MODELS[family], f"trainer.seq_len={SEQ}", "trainer.micro_batch_size=1",
                    f"trainer.global_batch_size={GLOBAL_BATCH}"])  # fmt: skip
    shape = shape_of(base.model)
    checked, accepted, disagreements = 0, 0, []
    for world in (1, 2, 4, 8):
        for layout in grid(world):
            ours = layout_problem(layout, shape, world, GLOBAL_BATCH, SEQ)
            theirs = trainer_verdict(base, layout, world)
            checked += 1
            accepted += theirs
            if (ours is None) != theirs:
                disagreements.append((layout, world, ours, theirs))
    assert not disagreements, disagreements[:5]
    # the grid must exercise both verdicts, or the test proves nothing
    assert 0 < accepted < checked, (accepted, checked)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("cp,cp_attention", [(1, "ring"), (2, "ring"), (2, "all_gather"),
                                             (2, "p2p")])  # fmt: skip
def test_cp_attention_gets_the_trainers_verdict(cp: int, cp_attention: str, dropout: float):
    base = resolve([*MODELS["llama"], f"model.dropout={dropout}", f"trainer.seq_len={SEQ}",
                    "trainer.micro_batch_size=1", f"trainer.global_batch_size={GLOBAL_BATCH}"])  # fmt: skip
    layout = Layout(cp=cp, cp_attention=cp_attention)
    ours = layout_problem(layout, shape_of(base.model), cp, GLOBAL_BATCH, SEQ)
    theirs = trainer_problem(base, layout, cp)
    assert (ours is None) == (theirs is None), (ours, theirs)
    if cp_attention == "p2p":
        assert ours == theirs  # ParallelConfig's words
    elif cp > 1 and cp_attention == "ring" and dropout:
        assert theirs is not None and ours is not None and theirs.startswith(ours)


def test_recompute_every_gets_the_trainers_verdict() -> None:
    base = resolve([*MODELS["llama"], f"trainer.seq_len={SEQ}", "trainer.micro_batch_size=1",
                    f"trainer.global_batch_size={GLOBAL_BATCH}"])  # fmt: skip
    shape = shape_of(base.model)
    verdicts = []
    for recompute, every in itertools.product(("none", "selective", "full"), (0, 1, 2, 7)):
        layout = Layout(recompute=recompute, recompute_every=every)
        ours = layout_problem(layout, shape, 1, GLOBAL_BATCH, SEQ) is None
        assert ours == trainer_verdict(base, layout, 1), layout
        verdicts.append(ours)
    # 0 is refused under every policy, positive values are accepted (used by full only)
    assert verdicts.count(False) == 3


@pytest.mark.parametrize(
    "layout,accepted",
    [
        (Layout(pp=2, pp_layers=(4, 2)), True),
        (Layout(pp=2, pp_layers=(0, 6)), True),  # an explicit chunk may be empty
        (Layout(pp=2, pp_layers=(6, 0)), True),
        # 8 chunks of 6 layers: only an explicit list splits them
        (Layout(pp=4, schedule="interleaved_1f1b", vpp=2, pp_layers=(1, 1, 1, 1, 1, 1, 0, 0)),
         True),
        (Layout(pp=4, schedule="interleaved_1f1b", vpp=2), False),
        (Layout(pp=2, schedule="zbv", pp_layers=(1, 2, 2, 1)), True),
        (Layout(pp=2, schedule="zbv", pp_layers=(3, 3)), False),  # a V has 2 chunks per rank
        (Layout(pp=2, pp_layers=(2, 2, 2)), False),
        (Layout(pp=2, pp_layers=(2, 3)), False),  # sums to 5
        (Layout(pp=2, pp_layers=(7, -1)), False),
        (Layout(pp=1, pp_layers=(6,)), False),
    ],
)  # fmt: skip
def test_pp_layers_get_the_trainers_verdict_and_message(layout: Layout, accepted: bool) -> None:
    base = resolve([*MODELS["llama"], f"trainer.seq_len={SEQ}", "trainer.micro_batch_size=1",
                    f"trainer.global_batch_size={GLOBAL_BATCH}"])  # fmt: skip
    world = layout.pp  # dp = 1: 8 micro-batches, enough for every schedule here
    ours = layout_problem(layout, shape_of(base.model), world, GLOBAL_BATCH, SEQ)
    theirs = trainer_problem(base, layout, world)
    assert (theirs is None) == accepted, theirs
    assert ours == theirs  # the same verdict and, for a refusal, the same words


def test_split_layers_equals_mt_parallels() -> None:
    split = pytest.importorskip("mt_parallel.pipeline.split")
    from mt_plan.layout import split_layers

    cases = [(n, pp * v, ()) for n in range(0, 41) for pp in (1, 2, 3, 4, 8) for v in (1, 2, 4)]
    cases += [(6, 2, (4, 2)), (6, 2, (0, 6)), (6, 3, (2, 2)), (6, 2, (2, 3)), (6, 2, (7, -1)),
              (6, 2, (3.0, 3)), (6, 0, ()), (6, 4, (1, 1, 1, 3))]  # fmt: skip
    refused = 0
    for n, chunks, layers in cases:
        try:
            theirs: list[int] | str = [
                len(r) for r in split.split_layers(n, chunks, list(layers) or None)
            ]
        except ValueError as error:
            theirs, refused = str(error), refused + 1
        try:
            ours: list[int] | str = split_layers(n, chunks, layers)
        except ValueError as error:
            ours = str(error)
        assert ours == theirs, (n, chunks, layers)
    assert 0 < refused < len(cases)
