"""Ring context parallelism (``parallel.cp_attention=ring``) priced as mt-parallel runs it.

* at cp = 1 the runtime never enters the ring, and neither does the price;
* per layer and micro-batch a rank sends its K|V block ``cp − 1`` times forward and again
  backward, and ``cp`` fp32 gradient blocks home; the blocks hide all of it but the last
  gradient hop when links are fast;
* the ring keeps its own message where all-gather keeps the whole sequence's expanded K/V
  (MLA), and its flash blocks hold no score matrices;
* its blocks together score the all-gather core's pairs at the same calibrated rate, plus
  the fp32 merges and step 0's GQA expansion;
* recompute that reruns the core reruns the ring forward (sends, blocks, MLA expansions);
* the search tries both and returns the ring where only the ring fits.
"""

from __future__ import annotations

import dataclasses

import pytest

from mt_plan.calibration import load_table
from mt_plan.cluster import load_cluster
from mt_plan.cost import RING_MERGE_PASSES, CostModel, Workload
from mt_plan.layout import Layout, layout_problem
from mt_plan.search import SearchSpace, search
from mt_plan.shape import ModelShape

LLAMA_8B_8L = ModelShape(
    name="llama3_8b_8l", family="llama", n_layers=8, dim=4096, vocab_size=128256, n_heads=32,
    n_kv_heads=8, head_dim=128, ffn_dim=14336,
)  # fmt: skip
MLA_16L = ModelShape(
    name="mla_16l", family="deepseek_v3", n_layers=16, dim=2048, vocab_size=32768, n_heads=16,
    ffn_dim=8192, attention="mla", kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128,
)  # fmt: skip


def _cost(shape: ModelShape, world: int, seq: int, global_batch: int, **work) -> CostModel:
    cluster = load_cluster("h200_nodes").with_gpus(world)
    return CostModel(shape, cluster, load_table("h200"),
                     Workload(seq_len=seq, global_batch=global_batch, **work))  # fmt: skip


def test_ring_at_cp_one_prices_as_no_context_parallelism() -> None:
    cost = _cost(LLAMA_8B_8L, 1, 8192, 2)
    plain, ring = cost.estimate(Layout()), cost.estimate(Layout(cp_attention="ring"))
    assert dataclasses.replace(ring, layout=None) == dataclasses.replace(plain, layout=None)
    assert Layout(cp_attention="ring").label() == Layout().label()


def test_ring_sends_a_block_per_step_and_hides_all_but_the_last_gradient_hop() -> None:
    # cp = 4 on one node, dp = 1, 2 micro-batches of one 8192-token sequence: t = 2048 local
    # tokens, a K|V block of t·2·H_kv·hd values (bf16 on the wire, its gradient fp32)
    cp, m, n = 4, 2, 8
    cost = _cost(LLAMA_8B_8L, cp, 8192, m)
    layout = Layout(cp=cp, cp_attention="ring")
    est = cost.estimate(layout)
    block = 2048 * 2 * 8 * 128
    per_layer = 2 * (cp - 1) * 2 * block + cp * 4 * block
    assert est.comm["cp"].payload_bytes == m * n * per_layer  # and no all-gather
    # NVLink: every step's block attention outlasts its sends; only the last gradient hop,
    # sent after the last block's backward, is exposed
    last_hop = cost._time("cp", "p2p", 4 * block, layout)
    assert est.comm["cp"].exposed == pytest.approx(m * n * last_hop, rel=1e-9)
    assert est.comm["cp"].exposed < est.comm["cp"].seconds / 4
    assert "ring" in layout.label() and "parallel.cp_attention=ring" in layout.overrides(m)


def test_ring_exposes_what_slow_links_cannot_hide() -> None:
    # 1 GB/s between the cp ranks: each step's send outlasts its block, so the exposed time
    # is the sends less the blocks that overlap them, more than the last hop alone
    cp, m = 4, 2
    cost = _cost(LLAMA_8B_8L, cp, 8192, m)
    tier = dataclasses.replace(cost.cluster.intra_node, bandwidth=1e9)
    slow = CostModel(cost.model, dataclasses.replace(cost.cluster, intra_node=tier), cost.table,
                     cost.work)  # fmt: skip
    layout = Layout(cp=cp, cp_attention="ring")
    est = slow.estimate(layout)
    core = est.compute["attention_core"]
    assert est.comm["cp"].seconds - core < est.comm["cp"].exposed < est.comm["cp"].seconds
    last_hop = slow._time("cp", "p2p", 4 * 2048 * 2 * 8 * 128, layout)
    assert est.comm["cp"].exposed > 2 * m * 8 * last_hop


def test_ring_keeps_its_block_where_all_gather_keeps_the_whole_sequence() -> None:
    # MLA at cp = 8: all-gather keeps the whole sequence's latent c and expanded k, v per
    # layer; the ring keeps its own latent and its fp32 output
    cp, seq = 8, 16384
    cost = _cost(MLA_16L, cp, seq, 1)
    gather = cost.estimate(Layout(cp=cp))
    ring = cost.estimate(Layout(cp=cp, cp_attention="ring"))
    T, S, H, A = seq // cp, seq, 16, 2
    per_layer = A * (S - T) * 512 + A * S * H * (128 + 64 + 128) - 4 * T * H * 128
    kept = gather.memory["activations"] - ring.memory["activations"]
    assert kept == pytest.approx(16 * per_layer, rel=1e-12)
    assert "ring_attention_scores" not in ring.memory  # flash blocks: no score matrices
    assert ring.peak_memory < gather.peak_memory


def test_the_ring_blocks_score_the_cores_pairs_at_its_rate() -> None:
    # Llama3-8B layers at cp = 4, sequence 8192: the four flash blocks of a rank score what
    # the all-gather core scores (t·t/2 pairs each), priced at the same calibrated rate for
    # the local shape; beside them 3 fp32 output-sized passes a step and step 0's GQA copy
    cp, seq = 4, 8192
    cost = _cost(LLAMA_8B_8L, cp, seq, 1)
    layout = Layout(cp=cp, cp_attention="ring")
    t, heads, hd = seq // cp, 32, 128
    ring = cost._ring(layout, heads, t, hd, hd, t * 2 * 8 * hd, 0.0)
    gpu = cost.cluster.gpu
    flops = 2.0 * heads * (t * t / 2) * 2 * hd
    core_bytes = 2 * heads * t * 4 * hd
    block_f = cost.table.compute_time(
        "attention_fwd", "bf16", (heads, t, hd), flops, core_bytes, gpu.peak_bf16_flops,
        gpu.memory_bandwidth,
    )[0]  # fmt: skip
    gathered = cost.table.compute_time(
        "attention_fwd", "bf16", (heads, t, hd), cp * flops, core_bytes, gpu.peak_bf16_flops,
        gpu.memory_bandwidth,
    )[0]  # fmt: skip
    merge = cost._membound("copy", RING_MERGE_PASSES * 4 * heads * t * hd, (heads, t))[0]
    expand = cost._membound("copy", 2 * 2 * heads * t * 2 * hd, (heads, t))[0]
    assert ring.compute[0] == pytest.approx(cp * (block_f + merge) + expand, rel=1e-12)
    assert cp * block_f == pytest.approx(gathered, rel=1e-12)  # the same pairs, the same rate
    # the merges and the GQA copy on top: within 2x of the core (the plain fp32 blocks the
    # runtime ran before 24788cd were priced at 17-21x it)
    assert gathered < ring.compute[0] < 2 * gathered


def test_the_search_returns_the_ring_where_only_the_ring_fits() -> None:
    cp, seq = 8, 16384
    cost = _cost(MLA_16L, cp, seq, 1, headroom=0.0, allocator_overhead=0.0)
    gather = cost.estimate(Layout(cp=cp)).peak_memory
    ring = cost.estimate(Layout(cp=cp, cp_attention="ring")).peak_memory
    space = SearchSpace(tp=[1], cp=[cp], pp=[1], dp_modes=["ddp"], micro_batches=[1],
                        recompute=["none"], fp8=["none"])  # fmt: skip
    roomy = search(cost, cp, space)
    assert [e.layout.cp_attention for e in roomy.ranked] == ["all_gather", "ring"]
    gpu = dataclasses.replace(cost.cluster.gpu, memory_bytes=(gather + ring) / 2)
    tight = CostModel(cost.model, dataclasses.replace(cost.cluster, gpu=gpu), cost.table,
                      cost.work)  # fmt: skip
    result = search(tight, cp, space)
    assert [e.layout.cp_attention for e in result.ranked] == ["ring"]
    assert [e.layout.cp_attention for e in result.too_big] == ["all_gather"]
    only_gather = search(tight, cp, dataclasses.replace(space, cp_attention=["all_gather"]))
    assert not only_gather.ranked


def test_the_ring_refuses_dropout_and_unknown_modes() -> None:
    dropout = dataclasses.replace(LLAMA_8B_8L, dropout=0.1)
    ring = Layout(cp=2, cp_attention="ring")
    assert "dropout" in layout_problem(ring, dropout, 2, 2, 8192)
    assert layout_problem(ring, LLAMA_8B_8L, 2, 2, 8192) is None
    assert layout_problem(Layout(cp=2), dropout, 2, 2, 8192) is None
    assert "valid: all_gather, ring" in layout_problem(
        Layout(cp=2, cp_attention="p2p"), LLAMA_8B_8L, 2, 2, 8192
    )
    with pytest.raises(ValueError, match="--cp-attention"):
        SearchSpace(cp_attention=["p2p"])


def test_recomputing_the_core_runs_the_ring_forward_again() -> None:
    # selective recompute reruns the core: its block attention, the MLA ring's kv_b expansions
    # and its forward sends, all charged to the backward
    cp, seq = 8, 16384
    cost = _cost(MLA_16L, cp, seq, 1)
    plain = cost._layer(True, Layout(cp=cp, cp_attention="ring"))
    again = cost._layer(True, Layout(cp=cp, cp_attention="ring", recompute="selective"))
    forward_sends = plain.ring.sends[0]
    assert again.ring.sends == (*plain.ring.sends, forward_sends)
    assert again.ring.exposed == (plain.ring.exposed[0], sum(plain.ring.exposed))
    # the ring's projections exceed all-gather's by one more kv_b forward over b·s tokens
    gather = cost._layer(True, Layout(cp=cp)).phase
    expansion = plain.phase.classes["attention_proj"] - gather.classes["attention_proj"]
    assert expansion > 0
    expected = plain.ring.compute[0] + expansion
    assert again.phase.classes["recompute"] == pytest.approx(expected, rel=1e-12)
