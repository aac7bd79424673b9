"""The memory peak's parts that depend on when the step frees them.

* the FP8 weight cache lives from the first forward until each layer's backward in the step's
  last micro-batch, so it is a forward-phase tensor: with one micro-batch a gradient-bound peak
  holds only the first layer's largest projection's FP8 weights beside every gradient (under
  rowwise also that weight gradient's bf16 result);
* under full recompute the checkpointed blocks keep no bf16 weight copy, and the largest of the
  forward's end, the loss's backward and a block's recomputation counts, not their sum; with
  ``recompute_every > 1`` the blocks it skips keep their activations and bf16 copies;
* a zero-bubble schedule holds each chunk's activations from its forward to its weight
  gradient ``W`` (torch's split backward keeps them from ``I`` for ``W``), so ZB-H1 charges
  ``p`` stage activations on every pipeline rank where 1F1B charges ``p − r``; over blocks
  recomputed whole the chunks' sinks keep the recomputed linears' inputs and output gradients
  until ``W``, so there a recomputed block is charged its bytes without recompute.
"""

from __future__ import annotations

import pytest

from mt_plan import cost as cost_module
from mt_plan.calibration import load_table
from mt_plan.cluster import load_cluster
from mt_plan.cost import CostModel, Workload
from mt_plan.layout import Layout
from mt_plan.shape import ModelShape


def _shape(n_layers: int, dim: int, ffn_dim: int, vocab: int = 128256) -> ModelShape:
    return ModelShape(
        name="llama", family="llama", n_layers=n_layers, dim=dim, vocab_size=vocab,
        n_heads=dim // 128, n_kv_heads=8, head_dim=128, ffn_dim=ffn_dim,
    )  # fmt: skip


def _memory(shape: ModelShape, seq: int, **layout) -> dict[str, float]:
    cost = CostModel(shape, load_cluster("h100_nodes").with_gpus(1), load_table("h100"),
                     Workload(seq_len=seq, global_batch=1))  # fmt: skip
    return cost.estimate(Layout(**layout)).memory


def test_fp8_weight_cache_is_freed_as_the_gradients_grow() -> None:
    # Llama3-70B's width, two layers, sequence 4096: the gradients outgrow the forward's tensors
    # (docs/plan.md: measured 57.14 GiB in bf16 and 57.20 under tensorwise on one H100)
    shape = _shape(2, 8192, 28672)
    params = shape.total_params()
    gradient_bound = 16 * params  # fp32 weights, AdamW's two moments, every gradient
    assert sum(_memory(shape, 4096).values()) == pytest.approx(gradient_bound, rel=1e-12)
    last = 8192 * 28672  # the first layer's largest projection (its MLP's)
    for fp8, held in (("tensorwise", 2 * last), ("delayed", 2 * last), ("rowwise", 4 * last)):
        memory = _memory(shape, 4096, fp8=fp8)
        assert memory["fp8_weight_cache"] > 0 and memory["fp8_last_backward"] == held
        assert sum(memory.values()) == pytest.approx(gradient_bound + held, rel=1e-12), fp8


def test_full_recompute_counts_the_largest_moment() -> None:
    # the 16k-token 4-layer slice of docs/plan.md (measured 31.74 GiB on one H100): the peak is
    # the loss's backward, the logits and their gradient beside the checkpoints and the head's
    # bf16 copy; neither the blocks' bf16 copies nor a recomputed block are alive then
    T, D, V = 16384, 4096, 128256
    shape = _shape(4, D, 14336)
    memory = _memory(shape, T, recompute="full")
    assert memory["logits"] == 2 * 2 * T * V
    assert memory["autocast_weight_copies"] == 2 * V * D
    assert memory["recompute_transient"] == 0
    assert memory["activations"] == 4 * 4 * T * D
    # a small vocabulary: a block's recomputation is the largest moment
    memory = _memory(_shape(4, D, 14336, vocab=320), T, recompute="full")
    assert memory["recompute_transient"] > 0
    assert memory["logits"] == memory["autocast_weight_copies"] == 0
    # many layers at a short sequence: the forward's end, every bf16 copy and the logits alone
    shape = _shape(16, D, 14336)
    memory = _memory(shape, 1024, recompute="full")
    linears = 16 * (D * (D + 2 * 1024 + D) + 3 * D * 14336)
    assert memory["autocast_weight_copies"] == 2 * (V * D + linears)
    assert memory["logits"] == 2 * 1024 * V
    assert memory["recompute_transient"] == 0


def test_blocks_recompute_every_skips_keep_activations_and_bf16_copies() -> None:
    # the 16k-sequence 4-layer slice again, every second block checkpointed (0 and 2): blocks 1
    # and 3 save what they save without recompute and keep their bf16 copies past the forward
    T, D, V = 16384, 4096, 128256
    shape = _shape(4, D, 14336)
    linears = D * (D + 2 * 1024 + D) + 3 * D * 14336  # one block's q, k, v, o and MLP
    kept_acts = _memory(shape, T)["activations"] / 4
    memory = _memory(shape, T, recompute="full", recompute_every=2)
    assert memory["activations"] == 2 * 4 * T * D + 2 * kept_acts
    # the loss's backward: the logits and their gradient, the head's and the kept blocks' copies
    assert memory["logits"] == 2 * 2 * T * V
    assert memory["autocast_weight_copies"] == 2 * (V * D + 2 * linears)
    assert memory["recompute_transient"] == 0
    # a small vocabulary: a checkpointed block's recomputation beside the kept blocks' copies
    small = _shape(4, D, 14336, vocab=320)
    every_block = _memory(small, T, recompute="full")
    memory = _memory(small, T, recompute="full", recompute_every=2)
    assert memory["recompute_transient"] == every_block["recompute_transient"] > 0
    assert memory["autocast_weight_copies"] == 2 * 2 * linears
    assert memory["logits"] == 0


_MEMORY = CostModel._memory


def _activations_per_rank(monkeypatch: pytest.MonkeyPatch, cost: CostModel, layout: Layout):
    """(the estimate, the activation bytes charged to each pipeline rank in turn)."""
    charged = []

    def recording(self, L, local, experts, linear, acts, *rest):
        charged.append(acts)
        return _MEMORY(self, L, local, experts, linear, acts, *rest)

    monkeypatch.setattr(cost_module.CostModel, "_memory", recording)
    return cost.estimate(layout), charged


def _llama3_8b_on_4_h100(seq: int) -> CostModel:
    return CostModel(_shape(32, 4096, 14336), load_cluster("h100_nodes").with_gpus(4),
                     load_table("h100"), Workload(seq_len=seq, global_batch=8))  # fmt: skip


def test_zero_bubble_holds_every_chunk_until_its_weight_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # pp = 4, 8 micro-batches, 8 equal layers a stage (a: one stage's saved bytes, the last
    # 1F1B rank's one chunk): 1F1B rank r holds p − r micro-batches, ZB-H1 p on every rank,
    # so ZB-H1 charges rank r r·a more
    pp = 4
    cost = _llama3_8b_on_4_h100(4096)
    _, one_f_one_b = _activations_per_rank(monkeypatch, cost, Layout(pp=pp, schedule="1f1b"))
    _, zero_bubble = _activations_per_rank(monkeypatch, cost, Layout(pp=pp, schedule="zero_bubble"))
    a = one_f_one_b[-1]
    assert a > 0
    assert one_f_one_b == [(pp - r) * a for r in range(pp)]
    assert zero_bubble == [pp * a] * pp
    assert [z - o for z, o in zip(zero_bubble, one_f_one_b, strict=True)] == [
        r * a for r in range(pp)
    ]


def test_the_activations_held_until_w_decide_whether_zero_bubble_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Llama3-8B at sequence 7168 on 4 H100s, pp = 4: 1F1B's fullest rank (rank 0, p chunks)
    # fits; under ZB-H1 the last rank, which also holds the logits and the head, holds p chunks
    # instead of one and does not fit, though it would at the F-to-I count (its rank's count
    # under 1F1B, which fits)
    pp = 4
    cost = _llama3_8b_on_4_h100(7168)
    one_f_one_b, charged = _activations_per_rank(monkeypatch, cost, Layout(pp=pp))
    zero_bubble, _ = _activations_per_rank(monkeypatch, cost, Layout(pp=pp, schedule="zero_bubble"))
    limit = cost.cluster.gpu.memory_bytes * (1.0 - cost.work.headroom)
    assert one_f_one_b.fits and not zero_bubble.fits
    held_to_w = (pp - 1) * charged[-1] * (1.0 + cost.work.allocator_overhead)
    assert zero_bubble.peak_memory - held_to_w <= limit < zero_bubble.peak_memory


def test_split_backward_over_recomputed_blocks_charges_what_the_sinks_keep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # pp = 4, full recompute: 1F1B keeps only the block inputs of the p − r chunks a rank
    # holds; ZB-H1 (a split backward) keeps each recomputed block's linears' inputs and dys
    # from I to W, charged as the block's bytes without recompute, p chunks on every rank:
    # the same charge as ZB-H1 without recompute
    pp = 4
    cost = _llama3_8b_on_4_h100(4096)
    _, one_f_one_b = _activations_per_rank(
        monkeypatch, cost, Layout(pp=pp, schedule="1f1b", recompute="full")
    )
    _, recomputed = _activations_per_rank(
        monkeypatch, cost, Layout(pp=pp, schedule="zero_bubble", recompute="full")
    )
    _, kept = _activations_per_rank(monkeypatch, cost, Layout(pp=pp, schedule="zero_bubble"))
    inputs = one_f_one_b[-1]
    assert one_f_one_b == [(pp - r) * inputs for r in range(pp)]
    assert recomputed == kept[-len(recomputed) :]
    assert recomputed[0] > pp * inputs  # what I keeps for W, not only the blocks' inputs
