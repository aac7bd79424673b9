"""The vision-language model under sequence parallel (tp=2) and context parallel (cp=2, the
decoder's K/V all-gathered or passed around the ring: ``parallel.cp_attention``) on two gloo
ranks equals one process in float64: loss, logits and every gradient over two SGD steps on
micro-batches whose images straddle cp chunks and SP shards, also with several samples packed
per row whose boundaries cross them (:mod:`vlm_checks`); and the trainer's digits run at those
layouts, one sample per row and packed, reports the one-process losses step by step and, under
cp, ends at its weights. One pool for the module."""

from __future__ import annotations

from pathlib import Path

import pytest
import train_checks
from test_train_vlm_parallel import NO_DROPOUT, RTOL, vlm_overrides
from vlm_checks import FP64_BOUND, rel_err, vlm_parallel_step

from mt_comm.testing import DistributedPool, PoolCache

pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")

LAYOUTS = {
    "tp2_sp": (2, 1, True, "all_gather"),
    "cp2": (1, 2, False, "all_gather"),
    "cp2_ring": (1, 2, False, "ring"),
}
"""``(tp, cp, sequence_parallel, cp_attention)`` of each layout."""


def layout_overrides(layout: str) -> dict[str, object]:
    tp, cp, sp, attention = LAYOUTS[layout]
    return {
        "parallel.tp": tp,
        "parallel.cp": cp,
        "parallel.sequence_parallel": sp,
        "parallel.cp_attention": attention,
    }


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.mark.parametrize("packed", [False, True], ids=["one_sample", "packed"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_step_matches_one_process_in_float64(layout: str, packed: bool, pool) -> None:
    tp, cp, sp, attention = LAYOUTS[layout]
    for result in pool.run(vlm_parallel_step, tp, cp, sp, packed=packed, cp_attention=attention):
        assert result["loss"] < FP64_BOUND
        assert result["logits"] < FP64_BOUND
        assert sorted(result["grads"]) == result["graded"]  # vision, projector, language
        worst = max(result["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < FP64_BOUND, worst
        for trained, expected in result["counts"]:
            assert trained == expected  # the cp group's unmasked targets: the whole sequence's


@pytest.fixture(scope="module")
def reference(digits: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    overrides = vlm_overrides(digits, **NO_DROPOUT)
    return train_checks.run_weights(overrides, tmp_path_factory.mktemp("single"))


WEIGHTS_BOUND = 1e-3
"""Final weights after 8 fp32 AdamW steps, max error relative to each tensor's largest entry:
the layouts differ by summation order only (ulps per step, losses within ``RTOL``), which
moved the weights by at most 3.5e-5 here (2026-12-07). A ring whose K/V did not travel on
(in the forward, or in the backward only) moved the worst tensor by 0.35 to 1.1 and the median
one by 4e-2 to 0.1."""
KEY_BIASES = "attention.k_proj.bias"
"""The encoder's key biases: their gradient is zero in exact arithmetic (softmax is invariant
to shifting every score of a query by ``q·b_k``), so it is rounding noise, which Adam's
``m/√v`` turns into steps of order ``lr`` in any direction; no output depends on them."""


def check_trainer_run(layout: str, per_rank: list[dict], single: dict) -> None:
    """Both ranks report the one process's losses step by step; under cp (DDP: every rank
    holds the whole model) their final weights are the one process's."""
    assert per_rank[0]["losses"] == per_rank[1]["losses"]  # every rank reports the mean loss
    # fp32 over 8 AdamW steps, as the tp=2 and dp=2 layouts (test_train_vlm_parallel.py).
    assert per_rank[0]["losses"] == pytest.approx(single["losses"], rel=RTOL)
    if LAYOUTS[layout][0] > 1:  # tp shards: the losses only
        return
    for rank in per_rank:
        assert rank["weights"].keys() == single["weights"].keys()
        errors = {
            name: rel_err(weight, single["weights"][name])
            for name, weight in rank["weights"].items()
            if not name.endswith(KEY_BIASES)
        }
        worst = max(errors.items(), key=lambda kv: kv[1])
        assert worst[1] < WEIGHTS_BOUND, worst


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_trainer_layout_matches_single_process(
    layout: str, pool, digits: Path, reference: dict, tmp_path: Path
) -> None:
    overrides = vlm_overrides(digits, **layout_overrides(layout), **NO_DROPOUT)
    per_rank = pool.run(train_checks.run_weights, overrides, tmp_path)
    check_trainer_run(layout, per_rank, reference)


PACKED = {"data.pack_samples": True, "trainer.seq_len": 64, **NO_DROPOUT}
"""Three digits samples per 64-token row; at cp=2 the rows' sample boundaries (every 19
tokens) fall inside the load-balanced chunks of 16."""


@pytest.fixture(scope="module")
def packed_reference(digits: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    overrides = vlm_overrides(digits, **PACKED)
    return train_checks.run_weights(overrides, tmp_path_factory.mktemp("packed_single"))


# cp2_ring in the default tier: no other trainer test runs ring attention with document masks.
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("cp2", marks=pytest.mark.slow),
        "cp2_ring",
        pytest.param("tp2_sp", marks=pytest.mark.slow),
    ],
)
def test_packed_trainer_layout_matches_single_process(
    layout: str, pool, digits: Path, packed_reference: dict, tmp_path: Path
) -> None:
    """The trainer's own path for packed rows: document ids and the per-sample positions cut
    for each cp rank by the runner (the float64 step test cuts them itself)."""
    overrides = vlm_overrides(digits, **layout_overrides(layout), **PACKED)
    per_rank = pool.run(train_checks.run_weights, overrides, tmp_path)
    check_trainer_run(layout, per_rank, packed_reference)
