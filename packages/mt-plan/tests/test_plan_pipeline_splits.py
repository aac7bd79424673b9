"""Pipeline splits the search tries beside the trainer's automatic one (``--end-layers-off``):
blocks moved off the last chunk, which carries the head, and off the first where it carries the
VLM's vision tower; the trainer accepts them and the search ranks a balanced one first."""

from __future__ import annotations

import dataclasses

from mt_plan.calibration import load_table
from mt_plan.cluster import load_cluster
from mt_plan.cost import CostModel, Workload
from mt_plan.layout import Layout, layout_problem
from mt_plan.search import SearchSpace, end_shifted_split, pipeline_splits, search
from mt_plan.shape import ModelShape

LLAMA_8B_8L = ModelShape(
    name="llama3_8b_8l", family="llama", n_layers=8, dim=4096, vocab_size=128256, n_heads=32,
    n_kv_heads=8, head_dim=128, ffn_dim=14336,
)  # fmt: skip


def test_end_shifted_splits_move_blocks_onto_the_other_chunks() -> None:
    assert end_shifted_split(8, 2, 0, 1) == (5, 3)  # no middle chunk: the other end takes it
    assert end_shifted_split(8, 2, 1, 0) == (3, 5)
    assert end_shifted_split(8, 2, 1, 1) is None  # nothing left to take them
    assert end_shifted_split(12, 4, 0, 1) == (3, 4, 3, 2)  # the middle chunks, fewest first
    assert end_shifted_split(12, 4, 1, 2) == (2, 5, 4, 1)
    assert end_shifted_split(10, 4, 0, 2) is None  # [2, 3, 3, 2]: the last would be empty


def test_only_a_model_with_a_vision_tower_shifts_its_first_chunk() -> None:
    space = SearchSpace(end_layers_off=[0, 1, 2])
    assert pipeline_splits(LLAMA_8B_8L, 4, space) == [(), (2, 3, 2, 1)]  # 2 off: last empty
    vlm = dataclasses.replace(LLAMA_8B_8L, blocks_before=4, n_layers=12)
    assert pipeline_splits(vlm, 4, SearchSpace(end_layers_off=[1])) == [
        (), (3, 4, 3, 2), (2, 4, 3, 3), (2, 4, 4, 2)
    ]  # fmt: skip
    assert pipeline_splits(LLAMA_8B_8L, 4, SearchSpace()) == [()]


def test_the_search_ranks_the_split_that_balances_the_head_first() -> None:
    # 8 Llama3-8B layers on 2 GPUs (pp = 2, 1F1B): the head (a 128,256-row GEMM) outweighs a
    # layer, so [5, 3] beats the automatic [4, 4]
    cost = CostModel(LLAMA_8B_8L, load_cluster("h200_nodes").with_gpus(2), load_table("h200"),
                     Workload(seq_len=8192, global_batch=8))  # fmt: skip
    space = SearchSpace(tp=[1], cp=[1], pp=[2], schedules=["1f1b"], dp_modes=["ddp"],
                        micro_batches=[1], recompute=["none"], fp8=["none"])  # fmt: skip
    automatic = search(cost, 2, space)
    assert [e.layout.pp_layers for e in automatic.ranked] == [()]
    shifted = search(cost, 2, dataclasses.replace(space, end_layers_off=[0, 1, 2]))
    best = shifted.ranked[0]
    assert best.layout.pp_layers == (5, 3)
    assert best.step_time < automatic.ranked[0].step_time
    assert {e.layout.pp_layers for e in shifted.ranked} == {(), (5, 3), (6, 2)}
    assert "parallel.pp_layers=[5,3]" in best.layout.overrides(8)
    assert layout_problem(Layout(pp=2, pp_layers=(5, 3)), LLAMA_8B_8L, 2, 8, 8192) is None
