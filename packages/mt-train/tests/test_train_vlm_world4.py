"""The vision-language model at cp=2 × tp=2 with sequence parallel on four gloo ranks equals
one process in float64 (loss, logits and every gradient over two SGD steps,
:mod:`vlm_checks`): both splits of the decoder's sequence at once, images straddling chunks
and shards."""

from __future__ import annotations

import pytest
from vlm_checks import FP64_BOUND, vlm_parallel_step, vlm_pipeline_step

from mt_comm.testing import DistributedPool


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=4) as pool:
        yield pool


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
        assert all(error < FP64_BOUND for error in result["losses"])
