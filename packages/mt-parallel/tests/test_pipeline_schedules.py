"""Pipeline schedules: torch's action lists, their invariants, the simulated bubble against the
published closed forms and the peak in-flight activations (no processes; exact arithmetic on
small dyadic costs, so equalities are exact); the activation meter's byte counting and the
bytes an action list predicts."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

from mt_parallel.pipeline import (
    SCHEDULES,
    Action,
    ActionKind,
    ActivationMeter,
    ChunkCosts,
    PipelineLayout,
    check_actions,
    chunks_per_rank,
    lower_with_comms,
    minimum_microbatches,
    predicted_peak_bytes,
    schedule_actions,
    simulate,
    split_layers,
    split_model,
    stage_to_rank,
)

# torch's IR letters (F forward, B full backward, I input gradient, W weight gradient)
F, B, W = ActionKind.FORWARD, ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_WEIGHT
I = ActionKind.BACKWARD_INPUT  # noqa: E741
SHAPES = [(2, 2), (2, 3), (2, 4), (4, 4), (4, 5), (4, 8), (8, 16)]
COSTS = [ChunkCosts(1, 1, 1), ChunkCosts(1, 2, 0.5), ChunkCosts(3, 2, 1), ChunkCosts(2, 1.5, 0.25)]


def run(name: str, pp: int, m: int, v: int = 2, costs: ChunkCosts | None = None):
    chunks = chunks_per_rank(name, v if name == "interleaved_1f1b" else 1)
    order = schedule_actions(name, pp, m, chunks)
    return order, simulate(order, pp * chunks, costs, chunks), chunks


def valid_shapes(name: str):
    chunks = 2 if name == "interleaved_1f1b" else 1
    return [(p, m) for p, m in SHAPES if m >= minimum_microbatches(name, p, chunks)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_single_stage_lists_equal_torch(name: str) -> None:
    """GPipe and 1F1B run on the action runtime: same order as torch's ``_get_pipeline_order``
    without its None padding and REDUCE_GRAD, except on 1F1B's last rank, where torch's list
    (drawn only, its runtime does not execute it) numbers forwards from 1 and runs F{m}."""
    cls = torch_schedules.ScheduleGPipe if name == "gpipe" else torch_schedules.Schedule1F1B
    for pp, m in valid_shapes(name):
        torch_order = cls._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=m))
        ours = schedule_actions(name, pp, m)
        for rank in range(pp):
            theirs = [
                a for a in torch_order[rank]
                if a is not None and a.computation_type != ActionKind.REDUCE_GRAD
            ]  # fmt: skip
            if name == "1f1b" and rank == pp - 1:
                assert theirs[0] == Action(rank, F, 1)
                assert Action(rank, F, m) in theirs  # a micro-batch that does not exist
                theirs = [a._replace(microbatch_index=a.microbatch_index - 1)
                          if a.computation_type == F else a for a in theirs]  # fmt: skip
            assert ours[rank] == theirs, (name, pp, m, rank)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_micro_batch_runs_f_then_b_or_f_i_w_once(name: str) -> None:
    for pp, m in valid_shapes(name):
        order, _, chunks = run(name, pp, m)
        placement = stage_to_rank(name, pp, chunks)
        check_actions(order, placement, m)  # raises on a violation
        kinds = {a.computation_type for acts in order.values() for e in acts for a in
                 (e.sub_actions or (e,))}  # fmt: skip
        assert (I in kinds) == SCHEDULES[name].split_backward or name == "dualpipev"


def test_check_actions_rejects_weight_before_input_grad() -> None:
    order = {0: [Action(0, F, 0), Action(0, W, 0), Action(0, I, 0)]}
    with pytest.raises(ValueError, match="follows"):
        check_actions(order, {0: 0}, 1)
    with pytest.raises(ValueError, match="expected F,B or F,I,W"):
        check_actions({0: [Action(0, F, 0)]}, {0: 0}, 1)


@pytest.mark.parametrize(
    ("order", "message"),
    [
        ({0: [Action(1, F, 0)]}, r"rank 0 action 0 \(.*\): stage 1 is not on rank 0"),
        ({0: [Action(0, F, 3)]}, r"rank 0 action 0 \(.*\): micro-batch outside 0..0"),
        (
            {0: [Action(0, F, 0), Action(0, B, 0), Action(0, B, 0)]},
            r"action 2 .*follows \['F', 'B'\]",
        ),
    ],
    ids=["placement", "micro-batch", "repeat"],
)
def test_check_actions_names_the_bad_action(order, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_actions(order, {0: 0, 1: 1}, 1)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_sends_match_receives_in_the_same_order(name: str) -> None:
    """After torch's lowering every send has its receive on the peer, and between two ranks the
    receives are posted in the order the sends are (otherwise blocking p2p deadlocks)."""
    for pp, m in valid_shapes(name):
        order, _, chunks = run(name, pp, m)
        placement = stage_to_rank(name, pp, chunks)
        lowered = lower_with_comms(order, placement)
        sent: dict[tuple[int, int], list] = {}
        received: dict[tuple[int, int], list] = {}
        for rank, actions in lowered.items():
            for a in actions:
                s, kind, k = a.stage_index, a.computation_type, a.microbatch_index
                if kind == ActionKind.SEND_F:
                    sent.setdefault((rank, placement[s + 1]), []).append(("F", s + 1, k))
                elif kind == ActionKind.SEND_B:
                    sent.setdefault((rank, placement[s - 1]), []).append(("B", s - 1, k))
                elif kind == ActionKind.RECV_F:
                    received.setdefault((placement[s - 1], rank), []).append(("F", s, k))
                elif kind == ActionKind.RECV_B:
                    received.setdefault((placement[s + 1], rank), []).append(("B", s, k))
        assert sent == received, (name, pp, m)
        expected = sum(
            1 for s in placement if s + 1 in placement and placement[s] != placement[s + 1]
        )
        assert sum(len(v) for v in sent.values()) == 2 * m * expected


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_one_stage_per_rank_bubble_is_p_minus_1_over_m_plus_p_minus_1(name: str) -> None:
    for pp, m in valid_shapes(name):
        for costs in COSTS:
            _, sim, _ = run(name, pp, m, costs=costs)
            assert sim.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
            for idle in sim.idle.values():  # (p−1)(F+B), B the full backward
                assert idle == pytest.approx((pp - 1) * (costs.forward + costs.full_backward))


def test_interleaved_1f1b_bubble_shrinks_by_v() -> None:
    """Megatron's interleaved schedule: idle (p−1)(F+B)/v for a stage's F, B; chunk costs are
    1/v of a stage's, so bubble fraction (p−1)/(v·m + p−1)."""
    for v in (2, 3):
        for pp, m in [(2, 2), (2, 4), (4, 4), (4, 8), (4, 12)]:
            stage = ChunkCosts(1, 1, 1)
            chunk = ChunkCosts(1 / v, 1 / v, 1 / v)
            _, sim, _ = run("interleaved_1f1b", pp, m, v=v, costs=chunk)
            assert sim.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)
            expected_idle = (pp - 1) * (stage.forward + stage.full_backward) / v
            assert max(sim.idle.values()) == pytest.approx(expected_idle)


def test_zb_h1_idle_is_p_minus_1_times_f_plus_b_minus_2w() -> None:
    """ZB-H1 (arXiv 2401.10241): (p−1)(F+B−2W) with B the full backward, i.e. 1F1B's bubble
    minus 2W per step of the warm-up, for any costs with W ≤ F and W ≤ B_input."""
    for pp, m in valid_shapes("zero_bubble"):
        for c in COSTS:
            _, sim, _ = run("zero_bubble", pp, m, costs=c)
            expected = (pp - 1) * (c.forward + c.full_backward - 2 * c.weight_grad)
            for idle in sim.idle.values():
                assert idle == pytest.approx(expected), (pp, m, c)


def test_zbv_and_dualpipev_bubbles_at_equal_chunk_costs() -> None:
    """With F = I = W per chunk: ZBV idles only the pipeline fill, (p−1)·F; DualPipeV idles
    (p−1)(F&B + B − 3W) (DualPipe's README, F&B the overlapped pair, here run back to back
    as torch does without an overlap function: F&B = F + B)."""
    c = ChunkCosts(1, 1, 1)
    for pp, m in valid_shapes("zbv"):
        _, sim, _ = run("zbv", pp, m, costs=c)
        if m >= 2 * pp:  # below that the V is never full and idle is larger
            assert set(sim.idle.values()) == {(pp - 1) * c.forward}, (pp, m)
    for pp, m in valid_shapes("dualpipev"):
        _, sim, _ = run("dualpipev", pp, m, costs=c)
        expected = (pp - 1) * (c.pair() + c.full_backward - 3 * c.weight_grad)
        assert set(sim.idle.values()) == {expected}, (pp, m)


def test_overlap_function_shortens_dualpipev() -> None:
    plain = run("dualpipev", 4, 16, costs=ChunkCosts(1, 1, 1))[1]
    overlapped = run("dualpipev", 4, 16, costs=ChunkCosts(1, 1, 1, overlap=max))[1]
    assert overlapped.makespan < plain.makespan


def test_peak_in_flight_activations() -> None:
    """In stage-activations per micro-batch: GPipe m; 1F1B and ZB-H1 p on rank 0; interleaved
    p·(1 + (p−1)/(p·v)) (Megatron); ZBV p (the ZB paper: as 1F1B); DualPipeV p + 1/2."""
    for pp, m in [(2, 4), (4, 8), (8, 16)]:
        assert max(run("gpipe", pp, m)[1].peak_activations.values()) == m
        for name in ("1f1b", "zero_bubble", "zbv"):
            assert max(run(name, pp, m)[1].peak_activations.values()) == pp, name
        assert run("1f1b", pp, m)[1].peak_activations[pp - 1] == 1
        peak = max(run("interleaved_1f1b", pp, m, v=2)[1].peak_activations.values())
        assert peak == pytest.approx(pp * (1 + (pp - 1) / (pp * 2)))
        assert max(run("dualpipev", pp, 2 * m)[1].peak_activations.values()) == pp + 0.5


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_too_few_micro_batches_is_one_clear_error(name: str) -> None:
    need = minimum_microbatches(name, 4, 2 if name == "interleaved_1f1b" else 1)
    if need == 1:
        assert schedule_actions(name, 4, 1)
        return
    with pytest.raises(ValueError, match=f"needs at least {need} micro-batches.*got {need - 1}"):
        schedule_actions(name, 4, need - 1, 2 if name == "interleaved_1f1b" else 1)


def test_bad_schedule_options() -> None:
    with pytest.raises(ValueError, match="valid: gpipe, 1f1b"):
        schedule_actions("pipedream", 2, 4)
    with pytest.raises(ValueError, match="exactly 2 chunk"):
        chunks_per_rank("zbv", 3)
    with pytest.raises(ValueError, match="needs pp_chunks ≥ 2"):
        chunks_per_rank("interleaved_1f1b", 1)
    with pytest.raises(ValueError, match="rounds"):
        schedule_actions("interleaved_1f1b", 4, 9, 2)


def test_simulator_reports_a_deadlock() -> None:
    order = {0: [Action(0, F, 0), Action(0, B, 0)], 1: [Action(1, B, 0), Action(1, F, 0)]}
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(order, 2)


def test_layer_splits() -> None:
    """Automatic: the remainder goes to the middle chunks first (the ends hold the embedding
    and the head); a user list must have one entry per chunk and sum to the layer count."""
    assert [len(r) for r in split_layers(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in split_layers(11, 4)] == [3, 3, 3, 2]
    assert [len(r) for r in split_layers(5, 2)] == [3, 2]
    assert split_layers(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match=r"sums to 5, the model has 4 layers"):
        split_layers(4, 2, [3, 2])
    with pytest.raises(ValueError, match="has 3 entries; the pipeline has 2 chunks"):
        split_layers(4, 2, [1, 1, 2])
    with pytest.raises(ValueError, match="3 layers cannot be split into 4 pipeline chunks"):
        split_layers(3, 4)


def test_every_chunk_gives_its_blocks_the_layouts_block_positions() -> None:
    """``block_positions`` (a VLM's per-sample positions of packed rows) replace the tokens'
    positions in every chunk's blocks; the first chunk's ``embed`` keeps the tokens'."""

    class Block(nn.Module):
        def forward(self, x, positions, document_ids):
            return x + positions.to(x.dtype)[..., None]

    model = nn.Module()
    model.embed, model.layers, model.norm = (
        nn.Identity(),
        nn.ModuleList([Block(), Block()]),
        nn.Identity(),
    )
    layout = PipelineLayout("embed", "layers", ("norm",), block_positions="sample_positions")
    first, last = split_model(model, layout, [0, 1], 2)
    x, rows = torch.zeros(1, 4, 2), torch.arange(4)
    restarting = torch.tensor([[0, 1, 0, 1]])
    out = last(first(x, rows, sample_positions=restarting), rows, sample_positions=restarting)
    assert torch.equal(out[..., 0], 2.0 * restarting)
    assert torch.equal(last(x, rows)[..., 0], rows[None].float())  # without them: the tokens'
    with pytest.raises(TypeError, match=r"every chunk \['sample_positions'\]"):
        first(x, rows, other=rows)
    plain = dataclasses.replace(layout, block_positions=None)
    with pytest.raises(TypeError, match=r"got keyword inputs \['sample_positions'\]"):
        split_model(model, plain, [0], 2)[0](x, rows, sample_positions=restarting)


def test_activation_meter_counts_each_saved_storage_once_until_released() -> None:
    """``relu(x·Wᵀ) · x`` in float64: the linear saves ``x`` (and its weight, excluded), relu its
    output, the product both again (the same storages, ``x`` through a view): 2 × 4·8·8 bytes.
    The backward releases them, and gradients equal a run without the meter."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)

    def run() -> torch.Tensor:
        return (torch.relu(linear(x)) * x.view(2, 16).view(4, 8)).sum()

    run().backward()
    expected, x.grad = x.grad, None
    meter = ActivationMeter([*linear.parameters(), *linear.buffers()])
    with meter:
        loss = run()
    assert meter.bytes == meter.peak == 2 * 4 * 8 * 8
    loss.backward()
    assert meter.bytes == 0 and meter.peak == 2 * 4 * 8 * 8
    assert torch.equal(x.grad, expected)
    meter.reset_peak()
    assert meter.peak == 0


def test_predicted_peak_bytes_is_the_simulated_count_without_split_backward() -> None:
    """With one byte count per chunk and nothing kept for ``W``, the predicted bytes are the
    simulator's peak in-flight chunks times it. A split backward whose ``I`` keeps everything
    for ``W`` (torch's, on the toy blocks: test_pipeline_world2.py) makes ZB-H1 hold ``p``
    chunks on every rank, not the simulator's ``F``-to-``I`` count ``p − r``."""
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"):
        v = chunks_per_rank(name, 2 if name == "interleaved_1f1b" else 1)
        order = schedule_actions(name, 4, 8, v)
        peaks = simulate(order, 4 * v, chunks_per_rank=v).peak_activations
        ones = dict.fromkeys(range(4 * v), 1.0 / v)
        zero = dict.fromkeys(range(4 * v), 0.0)
        for rank, actions in order.items():
            assert predicted_peak_bytes(actions, ones, zero) == peaks[rank], (name, rank)
    order = schedule_actions("zero_bubble", 4, 8, 1)
    ones = dict.fromkeys(range(4), 1.0)
    in_flight = simulate(order, 4).peak_activations
    assert [in_flight[r] for r in range(4)] == [4, 3, 2, 1]
    assert [predicted_peak_bytes(order[r], ones, ones) for r in range(4)] == [4, 4, 4, 4]


def test_weights_left_at_i_on_older_torch_are_the_gemm_weights_outside_sinks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The weights the older-torch warning names (``runtime._gemm_weights_outside_sinks``):
    none for a dense toy LM (its linears defer; embedding and norms are small) nor for an MoE
    one (its routers and experts defer too); a layer's own ``nn.Linear``; the experts where
    their layer does not defer: FP8 experts on the per-expert loop (the CPU), or FP8 experts
    whose gradient the backward sums over TP (sequence parallel at ep = 1); bf16 experts summed
    over TP defer (the queued work sums them)."""
    from toy_lm import DecoderLM

    from mt_parallel.moe import MoEConfig
    from mt_parallel.moe.experts import GroupedLinear
    from mt_parallel.pipeline.runtime import _gemm_weights_outside_sinks

    dense = DecoderLM(32, 16, 1, 2, 1, 32)
    assert _gemm_weights_outside_sinks(dense) == []
    dense.extra = nn.Linear(16, 16)
    assert _gemm_weights_outside_sinks(dense) == ["extra.weight"]
    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16)
    moe = DecoderLM(32, 16, 1, 2, 1, 32, moe=cfg)
    assert _gemm_weights_outside_sinks(moe) == []
    experts = [f"layers.0.mlp.experts.{p}_proj.weight" for p in ("gate", "up", "down")]
    fp8 = DecoderLM(32, 16, 1, 2, 1, 32, moe=cfg)
    for projection in fp8.layers[0].mlp.experts.children():
        projection.enable_fp8()
    assert sorted(_gemm_weights_outside_sinks(fp8)) == sorted(experts)
    monkeypatch.setattr(GroupedLinear, "sums_gradient_in_backward", property(lambda self: True))
    assert _gemm_weights_outside_sinks(moe) == []
    monkeypatch.setattr(
        type(fp8.layers[0].mlp.experts.gate_proj._fp8), "defers_weight_gradient", True
    )
    assert sorted(_gemm_weights_outside_sinks(fp8)) == sorted(experts)
