"""The planner's mirror of the trainer's layout rules gives the trainer's verdict.

For a grid of layouts on several families and world sizes, :func:`mt_plan.layout_problem`
must say "runs" exactly when mt-train's own checks accept the layout: composing the
``TrainConfig`` (``ParallelConfig`` and the family's ``check_parallel``), ``check_world`` and
mt-comm's ``ParallelDims`` (ep inside dp×cp).
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
    from mt_comm.parallel_state import ParallelDims
    from mt_parallel import ParallelConfig
    from mt_train.config import TrainConfig

    targets = ["attention", "mlp"] if layout.recompute == "selective_mlp" else ["attention"]
    try:
        parallel = ParallelConfig(
            tp=layout.tp, cp=layout.cp, pp=layout.pp, ep=layout.ep,
            sequence_parallel=layout.sp, pp_schedule=layout.schedule,
            pp_chunks=layout.vpp, data_parallel=layout.dp_mode,
            recompute={"selective_mlp": "selective", "full_keep": "full"}.get(
                layout.recompute, layout.recompute),
            recompute_targets=targets,
            recompute_keep=["attention"] if layout.recompute == "full_keep" else [],
            recompute_every=layout.recompute_every,
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
    except ValueError:
        return False
    return True


def grid(world: int):
    for tp, cp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2, 3, 4)):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        for sp, ep, mb, (schedule, vpp), mode, rc in itertools.product(
            (False, True), (1, 2, 4), (1, 2, 4),
            [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
             ("zero_bubble", 2), ("zbv", 1), ("dualpipev", 1)] if pp > 1 else [("1f1b", 1)],
            ("ddp", "fsdp", "zero1"), ("none", "full_keep"),
        ):  # fmt: skip
            yield Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, sp=sp, vpp=vpp, schedule=schedule,
                         dp_mode=mode, micro_batch=mb, recompute=rc)  # fmt: skip


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
