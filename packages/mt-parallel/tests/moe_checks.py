"""Functions run on every rank of a DistributedPool by the MoE expert-parallel tests.

Each rank builds the same full MoE layer (same seed), splits it over ``ep`` (and its shared
experts over ``tp``), runs its own tokens (dp×cp ranks see different tokens, TP ranks the same),
and reduces gradients as training does (dense ones averaged over dp×cp as DDP would, expert
ones by :func:`mt_parallel.moe.reduce_expert_gradients`). The reference is the unsplit layer on
one process, run on every rank's tokens in turn, loss averaged over the dp×cp ranks. Returns
the largest relative errors of the output, the auxiliary loss and every gradient.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from functools import partial
from unittest import mock

import torch
from parallel_checks import device_of, rel_err

import mt_comm
import mt_fp8
import mt_parallel as mp
from mt_parallel.moe import (
    MoE,
    MoEConfig,
    apply_expert_parallel,
    collect_aux_losses,
    reduce_expert_gradients,
)
from mt_parallel.moe.dispatch import all_to_all_in_flight

DIM, BATCH, SEQ = 16, 2, 6


def _loss(layer: MoE, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = layer(x)
    aux, _ = collect_aux_losses(layer)
    return (y * g).sum() + aux, y


def grad_errors(layer: MoE, reference: MoE, state, tp: int, local_experts: int) -> dict:
    """Each parameter's gradient error against the one-process ``reference``'s: its TP shard,
    or for an expert-parallel weight the slice of this ep rank's ``local_experts``."""
    full = {n: p.grad for n, p in reference.named_parameters()}
    shards = mp.shard_state_dict(full, mp.tp_shard_plan(reference), state.rank("tp"), tp)
    grads = {}
    for name, p in layer.named_parameters():
        expected = shards[name]
        if mp.is_expert_parameter(p):
            e = state.rank("ep")
            expected = full[name][e * local_experts : (e + 1) * local_experts]
        grads[name] = rel_err(p.grad, expected)
    return grads


def ep_parity(ep: int, tp: int = 1, fp8: str | None = None, **moe: object) -> dict:
    state = mt_comm.init_parallel_state(tp=tp, ep=ep)
    dtype = torch.float32 if fp8 else torch.float64
    cfg = MoEConfig(**{"num_experts": 8, "top_k": 2, "expert_ffn_dim": 16, **moe})
    layer = MoE(DIM, cfg).to(dtype)
    mp.init_weights(layer, seed=3)
    with torch.no_grad():
        layer.router.weight.mul_(25)  # spread the scores: ties must not decide the routing
    reference = copy.deepcopy(layer)
    mp.apply_tensor_parallel(layer, state.group("tp"))
    apply_expert_parallel(layer, state.group("ep"), state.group("edp"), state.group("dp_cp"))
    if fp8:
        mp.apply_fp8(layer, mt_fp8.recipe_from_name(fp8))
        mp.apply_fp8(reference, mt_fp8.recipe_from_name(fp8))
    ranks, rank = state.size("dp_cp"), state.rank("dp_cp")
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(ranks, BATCH, SEQ, DIM, generator=gen, dtype=dtype)
    gs = torch.randn(ranks, BATCH, SEQ, DIM, generator=gen, dtype=dtype)

    loss, y = _loss(layer, xs[rank], gs[rank])
    loss.backward()  # each rank's own loss; the mean over ranks comes from the reductions
    dense = [p for n, p in layer.named_parameters() if not mp.is_expert_parameter(p)]
    mp.all_reduce_gradients(dense, state.group("dp_cp"))  # what DDP does, in fp64
    reduce_expert_gradients(layer)

    ref_losses = []
    if fp8:
        # One call on every rank's tokens: an expert's weight-gradient GEMM then quantizes the
        # same rows (all ranks' tokens, in rank order, as the all-to-all delivers them) with the
        # same per-expert scales. Needs balancing="none" (an aux loss is per call).
        ref_loss, ref_y = _loss(reference, xs.flatten(0, 1), gs.flatten(0, 1))
        expected_y = ref_y.view(ranks, BATCH, SEQ, DIM)[rank]
        ref_losses = [loss.detach()] * ranks  # no per-rank reference loss
        (ref_loss / ranks).backward()
    else:
        for r in range(ranks):
            ref_loss, ref_y = _loss(reference, xs[r], gs[r])
            ref_losses.append(ref_loss)
            if r == rank:
                expected_y = ref_y
        (sum(ref_losses) / ranks).backward()

    grads = grad_errors(layer, reference, state, tp, cfg.num_experts // ep)
    return {"y": rel_err(y, expected_y), "loss": rel_err(loss, ref_losses[rank]), "grads": grads,
            "dropped": float(layer.load_stats.dropped_fraction)}  # fmt: skip


@contextlib.contextmanager
def _dispatch_trace(layer: MoE, ep: int) -> Iterator[list[str]]:
    """The order of the blocking all-to-alls (``counts sent``, ``rows sent``), the host read of
    the dispatcher's ``[2, ep, L]`` count tables (``counts read``) and the shared experts'
    forward."""
    events: list[str] = []
    all_to_all, tolist = mt_comm.all_to_all, torch.Tensor.tolist
    count_tables = (2, ep, layer.cfg.num_experts // ep)

    def traced_all_to_all(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        events.append("rows sent" if tensor.is_floating_point() else "counts sent")
        return all_to_all(tensor, *args, **kwargs)

    def traced_tolist(tensor: torch.Tensor) -> object:
        if tuple(tensor.shape) == count_tables:
            events.append("counts read")
        return tolist(tensor)

    hook = layer.shared_experts.register_forward_pre_hook(
        lambda *_: events.append("shared experts")
    )
    try:
        with (
            mock.patch.object(mt_comm, "all_to_all", traced_all_to_all),
            mock.patch.object(torch.Tensor, "tolist", traced_tolist),
        ):
            yield events
    finally:
        hook.remove()


def shared_expert_overlap(ep: int, tp: int = 1) -> dict:
    """The layer with shared experts split over ``ep`` (and ``tp`` with sequence parallel), run
    from the same weights and tokens with ``shared_expert_overlap`` ``off``, ``on``, and on
    inside :func:`~mt_parallel.moe.dispatch.all_to_all_in_flight` (``on, rows in flight``: the
    row all-to-alls started async, each wait preceded by a ``rows in flight`` event). Returns,
    per setting, the output, the input gradient and every parameter gradient, and the order of
    events (:func:`_dispatch_trace`; the in-flight events of the backward too)."""
    state = mt_comm.init_parallel_state(tp=tp, ep=ep)
    base = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=16, n_shared_experts=2)
    gen = torch.Generator().manual_seed(13 + state.rank("dp_cp"))
    x = torch.randn(BATCH, SEQ // tp, DIM, generator=gen, dtype=torch.float64)
    g = torch.randn(BATCH, SEQ // tp, DIM, generator=gen, dtype=torch.float64)
    results = {}
    for setting in ("off", "on", "on, rows in flight"):
        cfg = dataclasses.replace(base, shared_expert_overlap=setting != "off")
        layer = MoE(DIM, cfg).double()
        mp.init_weights(layer, seed=3)
        mp.apply_tensor_parallel(layer, state.group("tp"), sequence_parallel=tp > 1)
        apply_expert_parallel(layer, state.group("ep"), state.group("edp"), state.group("dp_cp"))
        x_in = x.clone().requires_grad_()
        with contextlib.ExitStack() as stack:
            events = stack.enter_context(_dispatch_trace(layer, ep))
            if setting == "on, rows in flight":
                stack.enter_context(all_to_all_in_flight(partial(events.append, "rows in flight")))
            loss, y = _loss(layer, x_in, g)
            loss.backward()
        values = {"y": y.detach(), "x_grad": x_in.grad}
        values.update((name, p.grad) for name, p in layer.named_parameters())
        results[setting] = {"values": values, "events": events}
    return results


def bias_update_is_global(ep: int) -> dict:
    """The aux-loss-free bias moves identically on every rank, from the world's counts."""
    state = mt_comm.init_parallel_state(ep=ep)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=16, balancing="aux_free")
    layer = MoE(DIM, cfg).double()
    mp.init_weights(layer, seed=3)
    apply_expert_parallel(layer, state.group("ep"), state.group("edp"), state.group("dp_cp"))
    gen = torch.Generator().manual_seed(11 + state.rank("dp_cp"))
    layer(torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64))
    local = layer.router.step_counts.clone()
    counts = mp.moe.update_expert_biases(layer)["router"]
    summed = local.clone()
    mt_comm.all_reduce(summed)
    return {"bias": layer.router.expert_bias.clone(), "counts": counts, "summed": summed}


def sp_parity(
    tp: int, ep: int = 1, dtype: str = "float64", device: str | None = None, **moe: object
) -> dict:
    """The layer at ``tp`` with sequence parallel (each TP rank given its S/tp tokens of its
    dp×cp rank's micro-batch), split over ``ep``, in ``dtype`` on ``device`` (default: this
    process's), against the unsplit float64 layer on one process on the CPU, run on every dp×cp
    rank's micro-batch in turn. Returns relative errors of the output, the input gradient, every
    parameter gradient, the logged auxiliary losses and MaxVio, and the exact-equality flags of
    the expert counts and (after the update) the aux-loss-free bias."""
    state = mt_comm.init_parallel_state(tp=tp, ep=ep)
    tp_group, tp_rank = state.group("tp"), state.rank("tp")
    dev, dt = device_of(device), getattr(torch, dtype)
    cfg = MoEConfig(**{"num_experts": 8, "top_k": 2, "expert_ffn_dim": 16, **moe})
    layer = MoE(DIM, cfg).double()
    mp.init_weights(layer, seed=3)
    with torch.no_grad():
        layer.router.weight.mul_(25)  # spread the scores: ties must not decide the routing
    reference = copy.deepcopy(layer)
    layer.to(dev, dt)
    mp.apply_tensor_parallel(layer, tp_group, sequence_parallel=True)
    apply_expert_parallel(layer, state.group("ep"), state.group("edp"), state.group("dp_cp"))
    ranks, rank = state.size("dp_cp"), state.rank("dp_cp")
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(ranks, BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
    gs = torch.randn(ranks, BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)

    def mine(full_BSD: torch.Tensor) -> torch.Tensor:
        return full_BSD.chunk(tp, dim=1)[tp_rank]

    x = mine(xs[rank]).to(dev, dt).clone().requires_grad_()
    y = layer(x)
    counts = layer.load_stats.counts_E.cpu()
    aux, logged = collect_aux_losses(layer)
    # This rank's share of Σ y·g plus the whole auxiliary loss, which every TP rank holds.
    ((y * mine(gs[rank]).to(dev, dt)).sum() + aux).backward()
    dense = [p for p in layer.parameters() if not mp.is_expert_parameter(p)]
    for p in dense:  # what DDP does
        mt_comm.all_reduce(p.grad, op="avg", group=state.group("dp_cp"))
    reduce_expert_gradients(layer)
    global_counts = mp.moe.update_expert_biases(layer)["router"].cpu()

    ref_losses = []
    for r in range(ranks):
        x_ref = xs[r].clone().requires_grad_()
        ref_y = reference(x_ref)
        ref_counts = reference.load_stats.counts_E.clone()
        ref_aux, ref_logged = collect_aux_losses(reference)
        ref_losses.append((ref_y * gs[r]).sum() + ref_aux)
        if r == rank:
            expected = (ref_y, x_ref, ref_counts, ref_logged)
    ref_step_counts = reference.router.step_counts.clone()
    (sum(ref_losses) / ranks).backward()
    mp.moe.update_expert_biases(reference)
    ref_y, x_ref, ref_counts, ref_logged = expected

    grads = grad_errors(layer, reference, state, tp, cfg.num_experts // ep)
    stats = {name: rel_err(value, ref_logged[name]) for name, value in logged.items()}
    return {
        "losses": {name: float(logged[name]) for name in ("moe_aux_loss", "moe_z_loss")},
        "y": rel_err(y, mine(ref_y)),
        "x_grad": rel_err(x.grad, mine(x_ref.grad) * ranks),  # own loss, not the mean's share
        "grads": grads,
        "stats": stats,
        "counts_equal": torch.equal(counts, ref_counts),
        "step_counts_equal": torch.equal(global_counts, ref_step_counts),
        "bias_equal": torch.equal(  # γ·sign steps: the same bits in float32 and float64
            layer.router.expert_bias.cpu().double(), reference.router.expert_bias.float().double()
        ),
        "bias_moved": bool(reference.router.expert_bias.abs().sum() > 0),
    }


def deferred_router_sp(tp: int) -> dict:
    """The router at ``tp`` with sequence parallel, its weight gradient deferred into a
    ``wgrad_sink`` (zero-bubble pipelines): before the queue runs the weight has no gradient;
    after, the gradient equals the plain backward's (``copy_to_group`` summing it over TP) bit
    for bit, and the unsplit float64 router's on the whole sequences (summed once, not twice).
    Returns the flags and the relative error against one process."""
    state = mt_comm.init_parallel_state(tp=tp)
    tp_group, tp_rank = state.group("tp"), state.rank("tp")
    cfg = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=16, z_loss_coeff=1e-2)
    reference = MoE(DIM, cfg).double()
    mp.init_weights(reference, seed=3)
    with torch.no_grad():
        reference.router.weight.mul_(25)  # spread the scores: ties must not decide the routing
    router = copy.deepcopy(reference.router)
    router.set_tensor_parallel(tp_group, sequence_parallel=True)
    gen = torch.Generator().manual_seed(7)
    x_BSD = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
    g_TK = torch.randn(BATCH, SEQ, cfg.top_k, generator=gen, dtype=torch.float64)

    def backward(module: mp.moe.Router, sequences: slice) -> None:
        routing = module(x_BSD[:, sequences])
        weights_TK = routing.weights_TK.view(BATCH, -1, cfg.top_k)
        ((weights_TK * g_TK[:, sequences]).sum() + routing.aux_loss + routing.z_loss).backward()

    rows = SEQ // tp
    mine = slice(tp_rank * rows, (tp_rank + 1) * rows)
    backward(router, mine)
    plain = router.weight.grad
    router.weight.grad, router.wgrad_sink = None, mt_fp8.WeightGradSink()
    backward(router, mine)
    graded_before_w, queued = router.weight.grad is not None, len(router.wgrad_sink)
    router.wgrad_sink.take()()
    # Each rank's share of Σ w·g plus the losses of the whole sequences, whose gradients the
    # TP ranks split between them (as in sp_parity).
    routing = reference.router(x_BSD)
    weights_TK = routing.weights_TK.view(BATCH, SEQ, cfg.top_k)
    ((weights_TK * g_TK).sum() + routing.aux_loss + routing.z_loss).backward()
    return {
        "equal": torch.equal(router.weight.grad, plain),
        "graded_before_w": graded_before_w,
        "queued": queued,
        "error": rel_err(router.weight.grad, reference.router.weight.grad),
    }


def deferred_experts_sp(tp: int) -> dict:
    """A float64 MoE layer at ``tp`` with sequence parallel (ep = 1, so the experts' weight
    gradients are summed over TP in the backward), run plainly and then with a
    ``wgrad_sink`` on every layer that takes one (zero-bubble pipelines): before the queue runs
    no expert weight has a gradient; after, each equals the plain backward's bit for bit (the
    TP sum happens once, at ``W``). Returns the flags and how many closures were queued."""
    state = mt_comm.init_parallel_state(tp=tp)
    tp_group, tp_rank = state.group("tp"), state.rank("tp")
    cfg = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=16, balancing="none")
    layer = MoE(DIM, cfg).double()
    mp.init_weights(layer, seed=3)
    mp.apply_tensor_parallel(layer, tp_group, sequence_parallel=True)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64).chunk(tp, dim=1)[tp_rank]
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    experts = [m for m in layer.modules() if isinstance(m, mp.moe.GroupedLinear)]
    (layer(x) * g).sum().backward()
    plain = [m.weight.grad for m in experts]
    sink = mt_fp8.WeightGradSink()
    for m in layer.modules():
        if hasattr(m, "wgrad_sink"):
            m.wgrad_sink = sink
    for m in experts:
        m.weight.grad = None
    (layer(x) * g).sum().backward()
    graded_before_w = any(m.weight.grad is not None for m in experts)
    queued = len(sink)
    sink.take()()
    return {
        "equal": all(torch.equal(m.weight.grad, p) for m, p in zip(experts, plain, strict=True)),
        "graded_before_w": graded_before_w,
        "queued": queued,
        "experts": len(experts),
        "defers": all(m.defers_weight_gradient for m in experts),
    }


def fp8_delayed_sp_scales(tp: int) -> dict:
    """Delayed-scaling FP8 experts at ``tp`` with sequence parallel: one forward and backward on
    this rank's tokens, then ``update_fp8_scales`` with no group (each layer's own amax group).
    Returns, per expert projection, whether the ranks' recorded amaxes differed before the
    update (each saw other tokens), whether their scales agree after it, and whether the FP8
    weight gradients are the TP sum (equal and nonzero on every rank)."""
    state = mt_comm.init_parallel_state(tp=tp)
    tp_group, tp_rank = state.group("tp"), state.rank("tp")
    recipe = mt_fp8.recipe_from_name("delayed")
    cfg = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=16, balancing="none")
    layer = MoE(DIM, cfg)
    mp.init_weights(layer, seed=3)
    mp.apply_tensor_parallel(layer, tp_group, sequence_parallel=True)
    mp.apply_fp8(layer, recipe, amax_group=tp_group)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, SEQ, DIM, generator=gen).chunk(tp, dim=1)[tp_rank]
    (layer(x) * x).sum().backward()
    projections = {n: getattr(layer.experts, n) for n in ("gate_proj", "up_proj", "down_proj")}
    before = {n: proj.fp8_meta.amax_history[0].clone() for n, proj in projections.items()}
    mt_fp8.update_fp8_scales(layer, recipe)
    result = {}
    for name, proj in projections.items():
        amaxes = mt_comm.all_gather(before[name][None], dim=0, group=tp_group)
        scales = mt_comm.all_gather(proj.fp8_meta.scale[None].clone(), dim=0, group=tp_group)
        grads = mt_comm.all_gather(proj.weight.grad[None], dim=0, group=tp_group)
        result[name] = {
            "amaxes_differed": not torch.equal(amaxes[0], amaxes[1]),
            "scales_agree": torch.equal(scales[0], scales[1]),
            "grads_summed": torch.equal(grads[0], grads[1]) and bool(grads[0].abs().sum() > 0),
        }
    return result


def sp_capacity(tp: int, **moe: object) -> dict:
    """Capacity under sequence parallel is per TP rank: the routed output of this rank's S/tp
    tokens equals the one-process layer's on those tokens alone, and the logged dropped fraction
    is the mean of the shards' (float64)."""
    state = mt_comm.init_parallel_state(tp=tp)
    tp_group, tp_rank = state.group("tp"), state.rank("tp")
    cfg = MoEConfig(**{"num_experts": 8, "top_k": 2, "expert_ffn_dim": 16, **moe})
    layer = MoE(DIM, cfg).double()
    mp.init_weights(layer, seed=3)
    with torch.no_grad():
        layer.router.weight.mul_(25)
    reference = copy.deepcopy(layer)
    mp.apply_tensor_parallel(layer, tp_group, sequence_parallel=True)
    gen = torch.Generator().manual_seed(7)
    shards = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64).chunk(tp, dim=1)
    y = layer(shards[tp_rank])
    dropped = []
    for r, shard in enumerate(shards):
        ref_y = reference(shard)
        dropped.append(reference.load_stats.dropped_fraction)
        if r == tp_rank:
            expected = ref_y
    return {
        "y": rel_err(y, expected),
        "dropped": rel_err(layer.load_stats.dropped_fraction, torch.stack(dropped).mean()),
        "dropped_fraction": float(layer.load_stats.dropped_fraction),
    }
