"""The vision-language model on four gloo ranks. cp=2 × tp=2 with sequence parallel equals
one process in float64 (loss, logits and every gradient over two SGD steps,
:mod:`vlm_checks`): both splits of the decoder's sequence at once, images straddling chunks
and shards. Under pp=2 one step with tp=2 + SP or with cp=2 equals one process in float64
(every micro-batch's loss, every gradient), and the digits captions train at pp=2 × dp=2 and
pp=2 × tp=2 + SP as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from vlm_checks import FP64_BOUND, vlm_parallel_step, vlm_pipeline_step

from mt_comm.testing import DistributedPool, PoolCache


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=4)


def test_cp2_tp2_sequence_parallel_step_matches_one_process(pool) -> None:
    for result in pool.run(vlm_parallel_step, 2, 2, True):
        assert result["loss"] < FP64_BOUND
        assert result["logits"] < FP64_BOUND
        assert sorted(result["grads"]) == result["graded"]
        worst = max(result["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < FP64_BOUND, worst
        assert all(trained == expected for trained, expected in result["counts"])


@pytest.mark.parametrize(
    ("layout", "schedule"),
    [({"tp": 2, "sp": True}, "zero_bubble"), ({"cp": 2}, "1f1b")],
    ids=["pp2-tp2-sp-zero_bubble", "pp2-cp2-1f1b"],
)
def test_pipeline_with_a_split_sequence_matches_one_process(
    pool, layout: dict, schedule: str
) -> None:
    """pp=2 with the decoder's sequence split over tp (SP: the first stage places each shard's
    image rows, one image straddling the shards) or cp (the first stage numbers the
    placeholders over the cp ranks, the last stage's loss counts their caption tokens)."""
    results = pool.run(vlm_pipeline_step, schedule, **layout)
    graded = set(results[0]["graded"])
    assert set().union(*(r["grads"] for r in results)) == graded
    for result in results:
        worst = max(result["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < FP64_BOUND, worst
        assert len(result["losses"]) == (4 if result["holds_last"] else 0)
        assert all(error < FP64_BOUND for error in result["losses"] + result["total"])
        assert len(result["total"]) == int(result["holds_last"])


# fp32 on the CPU: DP averages the gradients with an all-reduce and TP splits the dot products
# and the vocabulary, both reordering sums (a few ulps per step, as the pp=1 layouts of
# test_train_vlm_parallel.py); 8 AdamW steps keep the drift far below 1e-4.
RTOL = 1e-4


@pytest.fixture(scope="module")
def digits_reference(request: pytest.FixtureRequest, tmp_path_factory) -> tuple[Path, list]:
    pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")
    from test_train_vlm_parallel import vlm_overrides

    digits = request.getfixturevalue("digits")
    overrides = vlm_overrides(digits, **{"model.dropout": 0.0, "trainer.micro_batch_size": 2})
    return digits, train_checks.run_losses(overrides, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize(
    "layout",
    [{"parallel": "pp2"}, {"parallel": "tp2", "parallel.pp": 2}],
    ids=["pp2-dp2-1f1b", "pp2-tp2-sp-1f1b"],
)
def test_digits_pipeline_composed_matches_one_process(
    pool, digits_reference: tuple[Path, list], layout: dict, tmp_path: Path
) -> None:
    from test_train_vlm_parallel import vlm_overrides

    digits, reference = digits_reference
    extra = {"model.dropout": 0.0, "trainer.micro_batch_size": 2, **layout}
    per_rank = pool.run(train_checks.run_losses, vlm_overrides(digits, **extra), tmp_path)
    assert all(r == per_rank[0] for r in per_rank)
    assert per_rank[0] == pytest.approx(reference, rel=RTOL)
