"""The schedule simulator with one cost per stage: uneven stages (an uneven layer split, the
embedding and head on the end stages) timed with their own ``F``, ``I``, ``W`` (no processes;
small dyadic costs, so equalities are exact)."""

from __future__ import annotations

import itertools

import pytest

from mt_parallel.pipeline import ChunkCosts, predicted_peak_bytes, schedule_actions, simulate
from mt_parallel.pipeline.schedules import B, F, I, leaf_actions


def test_uneven_1f1b_stages_take_their_own_costs() -> None:
    # 1F1B, pp = 2, 3 micro-batches; stage 0: F = 1, B = I + W = 2; stage 1: F = 2, B = 4.
    # Rank 1 is the bottleneck: it starts after stage 0's first forward (1), then alternates
    # F and B for every micro-batch (3·6), and stage 0's last backward follows (2): 21.
    order = schedule_actions("1f1b", 2, 3, 1)
    light, heavy = ChunkCosts(1, 1, 1), ChunkCosts(2, 2, 2)
    uneven = simulate(order, 2, [light, heavy])
    assert uneven.makespan == 1 + 3 * (2 + 4) + 2
    assert uneven.timeline[1] == [(1, 3, "1F0"), (3, 7, "1B0"), (7, 9, "1F1"), (9, 13, "1B1"),
                                  (13, 15, "1F2"), (15, 19, "1B2")]  # fmt: skip
    assert uneven.busy == {0: 3 * (1 + 2), 1: 3 * (2 + 4)}
    # between the pipelines of two light and two heavy stages
    assert simulate(order, 2, light).makespan < uneven.makespan
    assert uneven.makespan < simulate(order, 2, heavy).makespan
    # a mapping from stage index gives the same timing as the sequence
    assert simulate(order, 2, {1: heavy, 0: light}).timeline == uneven.timeline


# One small case of every schedule: (name, pp, v, micro-batches).
EVERY_SCHEDULE = pytest.mark.parametrize(
    "name,pp,v,m",
    [("gpipe", 3, 1, 4), ("1f1b", 4, 1, 6), ("interleaved_1f1b", 2, 2, 4),
     ("zero_bubble", 3, 1, 5), ("zbv", 2, 2, 4), ("dualpipev", 2, 2, 4)],
)  # fmt: skip


@EVERY_SCHEDULE
def test_equal_per_stage_costs_equal_one_cost(name: str, pp: int, v: int, m: int) -> None:
    order = schedule_actions(name, pp, m, v)
    cost = ChunkCosts(1, 1.5, 0.5)
    one, each = simulate(order, pp * v, cost, v), simulate(order, pp * v, [cost] * (pp * v), v)
    assert each.timeline == one.timeline and each.peak_activations == one.peak_activations


def test_an_overlapped_pair_takes_its_forward_and_backward_stages_costs() -> None:
    # DualPipeV's OVERLAP_F_B pairs a forward of one stage with a full backward of another:
    # overlap(F of the forward's stage, I + W of the backward's stage), the forward stage's rule
    order = schedule_actions("dualpipev", 2, 4, 2)
    costs = [ChunkCosts(1 + s, 2 * (s + 1), 1, overlap=max) for s in range(4)]
    sim = simulate(order, 4, costs, 2)
    pairs = [(end - start, label) for r in sim.timeline for start, end, label in sim.timeline[r]
             if "OVERLAP" in label]  # fmt: skip
    assert pairs
    for seconds, label in pairs:
        fwd, bwd = label.strip("()").split(")")[0].split(";")
        f_stage, b_stage = int(fwd.split("F")[0]), int(bwd.split("B")[0])
        assert seconds == max(costs[f_stage].forward, costs[b_stage].full_backward)


def test_per_stage_costs_must_cover_every_stage() -> None:
    order = schedule_actions("1f1b", 2, 2, 1)
    with pytest.raises(ValueError, match="1 per-stage costs for a schedule of 2 stages"):
        simulate(order, 2, [ChunkCosts()])
    with pytest.raises(ValueError, match=r"stages \[0, 2\]; the schedule has stages 0..1"):
        simulate(order, 2, {0: ChunkCosts(), 2: ChunkCosts()})
    with pytest.raises(ValueError, match="must be ChunkCosts, got tuple"):
        simulate(order, 2, [ChunkCosts(), (1, 1, 1)])


def _entry_cost(entry, costs: list[ChunkCosts]) -> float:
    if entry.sub_actions is None:
        return costs[entry.stage_index].of(entry.computation_type)
    forward, backward = entry.sub_actions
    return costs[forward.stage_index].pair(costs[backward.stage_index])


@EVERY_SCHEDULE
def test_the_critical_path_sums_to_the_makespan(name: str, pp: int, v: int, m: int) -> None:
    order = schedule_actions(name, pp, m, v)
    costs = [ChunkCosts(1 + s % 3, 1.5 + s % 2, 0.25 * (s + 1)) for s in range(pp * v)]
    sim = simulate(order, pp * v, costs, v)
    assert sum(_entry_cost(e, costs) for e in sim.critical_path) == sim.makespan
    # each entry of the chain ends where the next one starts
    ends = {label: (start, end) for r in sim.timeline for start, end, label in sim.timeline[r]}
    spans = [ends[str(e)] for e in sim.critical_path]
    assert spans[0][0] == 0 and spans[-1][1] == sim.makespan
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_a_prepared_schedule_times_as_its_action_lists() -> None:
    from mt_parallel.pipeline.simulate import prepare

    order = schedule_actions("dualpipev", 2, 4, 2)
    costs = [ChunkCosts(1 + s, 2, 0.5) for s in range(4)]
    prepared = prepare(order, 4)
    assert simulate(prepared, 4, costs, 2) == simulate(order, 4, costs, 2)
    with pytest.raises(ValueError, match="prepared for 4 stages, not 2"):
        simulate(prepared, 2)


def test_chunks_held_until_w() -> None:
    """ZB-H1 holds ``p`` chunks on every rank from ``F`` to ``W`` where the ``F``-to-``I`` count
    is ``p − r`` (:mod:`mt_parallel.pipeline.memory`); schedules without a separate ``W`` hold
    each chunk to its full backward, so both counts agree (GPipe ``m``, 1F1B ``p − r``,
    interleaved 1F1B Megatron's ``p·(1 + (p−1)/(p·v)) − r`` with ``v = 2``)."""
    for pp, m in [(2, 4), (4, 8), (8, 16)]:
        zb = simulate(schedule_actions("zero_bubble", pp, m, 1), pp)
        assert zb.peak_activations_until_w == dict.fromkeys(range(pp), pp)
        assert zb.peak_activations == {r: pp - r for r in range(pp)}
        closed = {
            "gpipe": (1, {r: m for r in range(pp)}),
            "1f1b": (1, {r: pp - r for r in range(pp)}),
            "interleaved_1f1b": (2, {r: pp * (1 + (pp - 1) / (2 * pp)) - r for r in range(pp)}),
        }
        for name, (v, peaks) in closed.items():
            sim = simulate(schedule_actions(name, pp, m, v), pp * v, chunks_per_rank=v)
            assert sim.peak_activations_until_w == sim.peak_activations == peaks, name


@pytest.mark.parametrize(
    "name,pp,v,m",
    [("zero_bubble", 4, 1, 8), ("zero_bubble", 2, 2, 4), ("zero_bubble", 4, 2, 8),
     ("zbv", 4, 2, 8), ("dualpipev", 4, 2, 16)],
)  # fmt: skip
def test_held_until_w_is_the_predicted_bytes_when_i_keeps_everything(
    name: str, pp: int, v: int, m: int
) -> None:
    # predicted_peak_bytes with k_s = a_s (torch's split backward without a sink) and a_s = 1/v
    # (one stage's activations spread over its v chunks) is the F-to-W count; with k_s = 0 the
    # F-to-I count. Sums of multiples of 1/2 or 1: exact.
    order = schedule_actions(name, pp, m, v)
    sim = simulate(order, pp * v, chunks_per_rank=v)
    saved = dict.fromkeys(range(pp * v), 1.0 / v)
    nothing = dict.fromkeys(range(pp * v), 0.0)
    for rank, actions in order.items():
        assert predicted_peak_bytes(actions, saved, saved) == sim.peak_activations_until_w[rank]
        assert predicted_peak_bytes(actions, saved, nothing) == sim.peak_activations[rank]


def _event_loop(order, num_stages: int, costs: list[ChunkCosts]):
    """The simulator's model run literally, as a reference: sweep the ranks in turn, each as far
    as its producers have run, timing every entry as it runs; (makespan, per-rank timeline of
    (start, end, entry), critical path, busy)."""

    def producers(a):
        s, kind, k = a.stage_index, a.computation_type, a.microbatch_index
        if kind == F:
            return [] if s == 0 else [(s - 1, F, k)]
        if kind in (B, I):
            return [(s, F, k)] if s == num_stages - 1 else [(s + 1, "grad", k)]
        return [(s, I, k)]

    finished, made_by, after = {}, {}, {}
    position, clock = dict.fromkeys(order, 0), dict.fromkeys(order, 0.0)
    timeline = {r: [] for r in order}
    busy = dict.fromkeys(order, 0.0)
    while any(position[r] < len(order[r]) for r in order):
        for rank, actions in order.items():
            while position[rank] < len(actions):
                entry = actions[position[rank]]
                leaves = leaf_actions(entry)
                needs = [p for a in leaves for p in producers(a)]
                if any(n not in finished for n in needs):
                    break
                here = (rank, position[rank])
                start, after[here] = clock[rank], (rank, here[1] - 1) if here[1] else None
                for n in needs:
                    if finished[n] > start:
                        start, after[here] = finished[n], made_by[n]
                cost = _entry_cost(entry, costs)
                end = start + cost
                for a in leaves:
                    s, kind, k = a.stage_index, a.computation_type, a.microbatch_index
                    for key in [(s, kind, k)] + ([(s, "grad", k)] if kind in (B, I) else []):
                        finished[key], made_by[key] = end, here
                clock[rank], busy[rank] = end, busy[rank] + cost
                timeline[rank].append((start, end, entry))
                position[rank] += 1
    last = max(order, key=clock.__getitem__)
    chain, link = [], (last, len(order[last]) - 1)
    while link is not None:
        chain.append(order[link[0]][link[1]])
        link = after[link]
    return max(clock.values()), timeline, chain[::-1], busy


@pytest.mark.parametrize(
    "name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4),
               ("zero_bubble", 1), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)],
)  # fmt: skip
def test_the_prepared_order_times_as_the_event_loop(name: str, v: int) -> None:
    # simulate runs each entry once in prepare's order; the event loop above sweeps the ranks.
    # Every time is a sum of the same costs in the same order, so they agree bit for bit:
    # start and end of every entry, the critical path (ties included) and the makespan.
    for pp, m, heavy_ends in itertools.product((2, 3, 4), (1, 2, 3, 4, 5), (False, True)):
        m *= 2 * pp if name == "dualpipev" else pp
        chunks = pp * v
        costs = [ChunkCosts(1 + 0.1 * (c * 7 % 5), 0.9 + 0.07 * (c * 3 % 4), 0.3 + 0.11 * (c % 6))
                 for c in range(chunks)]  # fmt: skip
        if heavy_ends:  # the embedding on the first chunk, the head and loss on the last
            costs[0] = ChunkCosts(1.3, 0.2, 0.1)
            costs[-1] = ChunkCosts(2.7, 3.1, 1.9)
        order = schedule_actions(name, pp, m, v)
        sim = simulate(order, chunks, costs, v)
        makespan, timeline, chain, busy = _event_loop(order, chunks, costs)
        assert sim.makespan == makespan, (pp, m, heavy_ends)
        assert sim.timeline == {
            r: [(start, end, str(e)) for start, end, e in entries]
            for r, entries in timeline.items()
        }
        assert sim.critical_path == chain
        assert sim.busy == busy
        by_rank = sim.schedule.by_rank
        assert all(sim.ends[sim.waited_for[k]] == timeline[r][i][0]
                   for r in by_rank for i, k in enumerate(by_rank[r]))  # fmt: skip
