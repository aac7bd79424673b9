"""Functions run on every rank of a DistributedPool by the ring-CP MLA tests: ``cp_parity`` of
:mod:`mla_checks` under ``cp_attention=ring`` with the ring's point-to-point messages counted."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import mla_checks
import torch
import torch.distributed as dist
from mla_checks import FP8_SHAPES, SEQ_CP
from parallel_checks import fp8_gemm_bound, rel_err

import mt_comm
import mt_parallel as mp
from mt_parallel.mla import MultiLatentAttention


@contextlib.contextmanager
def ring_sends() -> Iterator[list[tuple[int, int]]]:
    """Record ``(tag, elements)`` of every tensor this rank sends through
    ``torch.distributed.batch_isend_irecv`` (the ring's only way out) while inside."""
    seen: list[tuple[int, int]] = []
    original = dist.batch_isend_irecv

    def counted(ops: list[Any]) -> Any:
        seen.extend((op.tag, op.tensor.numel()) for op in ops if op.op is dist.isend)
        return original(ops)

    dist.batch_isend_irecv = counted
    try:
        yield seen
    finally:
        dist.batch_isend_irecv = original


def ring_cp_parity(**kwargs: Any) -> dict:
    """:func:`mla_checks.cp_parity` with ``ring=True``, plus ``sends``: what this rank sent."""
    with ring_sends() as sends:
        result = mla_checks.cp_parity(ring=True, **kwargs)
    result["sends"] = sends
    return result


# ----------------------------------------------------------------------------------- FP8
SPIKE = 14
"""A token whose latent holds the sequence's largest entry (:func:`spike_latent`): in rank 0's
late chunk at cp=2 (positions 12-15) and at cp=4 (14-15), which the ranks after 0 never
expand (they take only the early chunk of a block from a rank before them)."""


def spike_latent(layer: MultiLatentAttention, x_BSD: torch.Tensor) -> None:
    """Make token :data:`SPIKE` of ``x`` 3 times the unit vector of ``kv_a``'s first row: its
    normed latent then peaks in that channel above every random token's at these shapes and
    seeds (:func:`ring_fp8_bounds` returns whether it does), so the whole sequence's latent amax
    is the spike's."""
    row = layer.kv_a_proj.weight.detach()[0]
    x_BSD[:, SPIKE] = 3 * row / row.norm()


class KvbCalls:
    """The ``kv_b`` GEMMs autograd goes back through, in order: each one's input ``x`` and
    output gradient ``dy`` (filled in by the backward), as ``(tokens, features)`` matrices."""

    def __init__(self, mla: MultiLatentAttention) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        linear = mla.kv_b_proj
        original = linear.forward_prepared

        def traced(x_BTK: torch.Tensor) -> torch.Tensor:
            y_BTN = original(x_BTK)
            if y_BTN.requires_grad:  # the ring's forward expands without a graph
                call = {"x": x_BTK.detach().reshape(-1, x_BTK.shape[-1])}
                self.calls.append(call)
                y_BTN.register_hook(lambda dy, c=call: c.update(dy=dy.reshape(-1, dy.shape[-1])))
            return y_BTN

        linear.forward_prepared = traced  # type: ignore[method-assign]


def fp8_error_model(linear: Any, role: Any, values: torch.Tensor) -> tuple[float, float, bool]:
    """``(rel, floor_rel, saturated)`` of ``values`` quantized as ``role`` of the FP8 ``linear``
    (tensorwise; mt_fp8.formats): |q(v)·s − v| ≤ rel·|v| + floor with ``rel`` the format's
    relative rounding error and ``floor`` half its subnormal spacing times the scale ``s``
    (delayed scaling's once its scales are ready, else the tensor's own amax over the format
    maximum); ``floor_rel`` is ``floor / max|values|``, as :func:`parallel_checks.fp8_gemm_bound`
    takes it. ``saturated``: some value lies beyond the format's range at ``s``."""
    fmt = linear.recipe.formats.for_role(role)
    meta = linear.fp8_meta.meta_for(role)
    amax = float(values.abs().max())
    if meta.has_delayed_state and meta.scales_ready:
        scale = float(meta.scale[int(role)])
    else:
        scale = amax / fmt.max
    floor = fmt.min_subnormal / 2 * scale
    return (
        fmt.relative_rounding_error,
        floor / max(amax, 1e-30),
        amax > fmt.saturation_threshold * scale,
    )


def ring_fp8_bounds(recipe: str, gemms: tuple[str, ...]) -> dict:
    """MLA under ring CP at cp = world against one process, ``kv_b`` in FP8 on both sides
    (``recipe``: ``delayed`` or ``tensorwise`` scaling, emulated, its ``gemms`` in FP8), fp32.

    Delayed scaling runs two steps on the same data (the spiked token of :func:`spike_latent`)
    and compares the second, whose scales come from the first step's amaxes; tensorwise runs
    one. The compared forwards must then quantize alike (delayed: one agreed scale per role;
    tensorwise: no FP8 forward GEMM), so ``kv_b``'s output gradients sum over the ranks to the
    one process's up to fp32 rounding, and only their quantization (each rank's partial vs the
    total) differs. Returns the errors of the output, of the gradients, of the normed latent
    ``c``'s gradient (every rank's FP8 dgrad contributions summed around the ring) and of
    ``kv_b``'s weight gradient (summed over cp), the last two as fractions of their bound (the
    FP8 errors of every call on both sides, :func:`parallel_checks.fp8_gemm_bound`), whether any
    quantized tensor saturated, whether the spiked token holds the latent's amax alone, and
    ``kv_b``'s delayed-scaling history and scales."""
    from mt_fp8 import DelayedScaling, TensorRole, TensorwiseScaling, update_fp8_scales

    cp = dist.get_world_size()
    state = mt_comm.init_parallel_state(cp=cp)
    cp_group, rank = state.group("cp"), state.rank("cp")
    reference = MultiLatentAttention(**FP8_SHAPES, q_lora_rank=16)
    mp.init_weights(reference, seed=5)
    layer = copy.deepcopy(reference)
    mp.apply_context_parallel(layer, cp_group, ring=True)
    # margin=1: the second step's tensors may exceed the first's amaxes a little (its forward
    # quantizes differently), and a doubled range keeps them unsaturated (checked below).
    delayed = recipe == "delayed"
    fp8 = DelayedScaling(amax_history_len=4, margin=1) if delayed else TensorwiseScaling()
    for module in (reference, layer):
        module.kv_b_proj.enable_fp8(fp8, backend="emulate", fp8_gemms=gemms)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, SEQ_CP, FP8_SHAPES["dim"], generator=gen)
    g = torch.randn(2, SEQ_CP, FP8_SHAPES["dim"], generator=gen)
    spike_latent(reference, x)
    positions = torch.arange(SEQ_CP) + 20
    latent_grads: dict[str, torch.Tensor] = {}  # the step's gradient of the normed latent c
    for _ in range(2 if delayed else 1):
        for module in (reference, layer):
            module.zero_grad(set_to_none=True)
        traced = {"ring": KvbCalls(layer), "one": KvbCalls(reference)}
        hooks = []
        for side, module in (("ring", layer), ("one", reference)):

            def keep(_m: Any, _i: Any, c: torch.Tensor, side: str = side) -> None:
                c.register_hook(lambda dc: latent_grads.__setitem__(side, dc))

            hooks.append(module.kv_a_norm.register_forward_hook(keep))
        x_ref = x.clone().requires_grad_()
        expected = reference(x_ref, positions)
        (expected * g).sum().backward()
        x_local = mp.shard_sequence(x, 1, cp_group).requires_grad_()
        y = layer(x_local, mp.shard_sequence(positions, 0, cp_group))
        (y * mp.shard_sequence(g, 1, cp_group)).sum().backward()
        for hook in hooks:
            hook.remove()
        for module in (reference, layer):
            del module.kv_b_proj.forward_prepared
            if delayed:
                update_fp8_scales(module, fp8)
    # The bounds, from every kv_b call autograd went back through: one call on one process,
    # cp on each ring rank (step s expands the block of rank r − s: all its tokens, or its early
    # chunk when that rank comes before this one), placed at the tokens each call expanded.
    weight = reference.kv_b_proj.weight.detach()
    linear = {"ring": layer.kv_b_proj.fp8_linear, "one": reference.kv_b_proj.fp8_linear}
    bounds = {}
    saturated = False
    for side, calls in traced.items():
        dgrad_BTC = torch.zeros(2, SEQ_CP, FP8_SHAPES["kv_lora_rank"], dtype=torch.float64)
        wgrad = torch.zeros_like(weight, dtype=torch.float64)
        for step, call in enumerate(calls.calls):
            x_MK, dy_MN = call["x"], call["dy"]
            *fmt_x, sat_x = fp8_error_model(linear[side], TensorRole.INPUT, x_MK)
            *fmt_dy, sat_dy = fp8_error_model(linear[side], TensorRole.GRAD_OUTPUT, dy_MN)
            *fmt_w, sat_w = fp8_error_model(linear[side], TensorRole.WEIGHT, weight)
            saturated |= sat_x or sat_dy or sat_w
            if side == "one":
                tokens = torch.arange(SEQ_CP)
            else:
                src = (rank - step) % cp
                tokens = mp.load_balanced_positions(SEQ_CP, cp, src)
                tokens = tokens if src >= rank else tokens[: len(tokens) // 2]
            if "dgrad" in gemms:
                dgrad_BTC[:, tokens] += fp8_gemm_bound(dy_MN, weight.T, fmt_dy, fmt_w).view(
                    2, len(tokens), -1
                )
            if "wgrad" in gemms:
                wgrad += fp8_gemm_bound(dy_MN.T, x_MK.T, fmt_dy, fmt_x)
        if side == "ring":
            dgrad_BTC, wgrad = (
                mt_comm.all_reduce(dgrad_BTC, group=cp_group),
                mt_comm.all_reduce(wgrad, group=cp_group),
            )
        bounds[side] = {"dgrad": mp.shard_sequence(dgrad_BTC, 1, cp_group), "wgrad": wgrad}

    def bounded(actual: torch.Tensor, expected: torch.Tensor, role: str) -> float:
        """|actual − expected| as a fraction of the bound (and fp32 rounding, 1e-5 of the
        largest entry, where the bound is zero: GEMMs in high precision)."""
        bound = bounds["ring"][role] + bounds["one"][role]
        bound = bound + 1e-5 * expected.detach().double().abs().max()
        error = (actual.detach().double() - expected.detach().double()).abs()
        return float((error / bound).max())

    grads = {
        name: rel_err(mt_comm.all_reduce(p.grad.clone(), group=cp_group), ref.grad)
        for (name, p), ref in zip(layer.named_parameters(), reference.parameters(), strict=True)
    }
    result = {
        "y": rel_err(y, mp.shard_sequence(expected, 1, cp_group)),
        "x_grad": rel_err(x_local.grad, mp.shard_sequence(x_ref.grad, 1, cp_group)),
        "grads": grads,
        "latent_grad_in_bound": bounded(
            latent_grads["ring"], mp.shard_sequence(latent_grads["one"], 1, cp_group), "dgrad"
        ),
        "kv_b_grad_in_bound": bounded(
            mt_comm.all_reduce(layer.kv_b_proj.weight.grad.clone(), group=cp_group),
            reference.kv_b_proj.weight.grad,
            "wgrad",
        ),
        "saturated": saturated,
        "spike_holds_the_amax": spike_holds_the_amax(traced["one"].calls[0]["x"]),
        "metas": {},
    }
    if delayed:
        for side, module in (("ring", layer), ("one", reference)):
            meta = module.kv_b_proj.fp8_meta
            result["metas"][side] = {"history": meta.amax_history.clone(), "scale": meta.scale}
    return result


def spike_holds_the_amax(latent_MC: torch.Tensor) -> bool:
    """Whether token :data:`SPIKE` of the one process's ``kv_b`` input (its rows, two sequences
    of :data:`~mla_checks.SEQ_CP` tokens) holds a larger entry than every other token."""
    latent_BSC = latent_MC.abs().view(2, SEQ_CP, -1)
    others = [s for s in range(SEQ_CP) if s != SPIKE]
    return bool(latent_BSC[:, SPIKE].max() > latent_BSC[:, others].max())


# --------------------------------------------------------------------- precision regions
def ring_regions(region: str, fp8: bool) -> dict:
    """MLA under ring CP at cp = world, ``kv_b`` in FP8 (tensorwise, emulated) if ``fp8``, else
    high precision, its forward run inside ``region``: ``autocast`` (bf16 ``torch.autocast``) or
    ``fp8_off`` (``mt_fp8.fp8_autocast(enabled=False)``), its backward outside (as the trainer
    runs them). Returns the number of ``kv_b`` expansions (``expansions``: the forward's cp,
    then the backward's cp, in ring order), the dtypes of each forward expansion and its
    backward counterpart and whether they are the same bits, and for plain ring attention on
    bf16 q, k, v whether its output and gradients are the same bits under bf16 autocast as
    without (``plain_ring_ignores_autocast``)."""
    import mt_fp8
    from mt_fp8 import TensorwiseScaling

    cp = dist.get_world_size()
    state = mt_comm.init_parallel_state(cp=cp)
    cp_group = state.group("cp")
    layer = MultiLatentAttention(**FP8_SHAPES, q_lora_rank=16)
    mp.init_weights(layer, seed=5)
    mp.apply_context_parallel(layer, cp_group, ring=True)
    if fp8:
        layer.kv_b_proj.enable_fp8(TensorwiseScaling(), backend="emulate")
    outputs: list[torch.Tensor] = []
    original = layer.kv_b_proj.forward_prepared

    def recorded(x_BTK: torch.Tensor) -> torch.Tensor:
        y_BTN = original(x_BTK)
        outputs.append(y_BTN.detach().clone())
        return y_BTN

    layer.kv_b_proj.forward_prepared = recorded  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, SEQ_CP, FP8_SHAPES["dim"], generator=gen)
    positions = mp.shard_sequence(torch.arange(SEQ_CP) + 20, 0, cp_group)
    x_local = mp.shard_sequence(x, 1, cp_group).requires_grad_()
    if region == "autocast":
        context: Any = torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        context = mt_fp8.fp8_autocast(enabled=False)
    with context:
        y = layer(x_local, positions)
    y.float().square().sum().backward()
    forward, backward = outputs[:cp], outputs[cp:]

    q, k, v, dout = (
        mp.shard_sequence(torch.randn(2, 4, SEQ_CP, 8, generator=gen), 2, cp_group).bfloat16()
        for _ in range(4)
    )
    runs = []
    for autocast in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = mp.ring_attention(*leaves, cp_group)
        out.backward(dout)
        runs.append([out.detach(), *(t.grad for t in leaves)])
    return {
        "expansions": len(outputs),
        "dtypes": [(f.dtype, b.dtype) for f, b in zip(forward, backward, strict=True)],
        "same_bits": [torch.equal(f, b) for f, b in zip(forward, backward, strict=True)],
        "plain_ring_ignores_autocast": all(
            torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True)
        ),
    }


# ------------------------------------------------------------------ the trainer's path
FP8_SKIP_BUT_KV_B = ("q_a_proj", "q_b_proj", "kv_a_proj", "o_proj", "mlp")
"""Linears kept high precision in :func:`ring_fsdp_lm`: every one but ``kv_b`` (the LM head
stays high precision as in the trainer)."""


def ring_fsdp_lm(dp: int = 1, gemms: tuple[str, ...] = ("forward",)) -> dict:
    """A two-block decoder LM with MLA attention (:mod:`toy_lm`'s, its attentions replaced)
    through :func:`mt_parallel.parallelize` as the trainer runs it: ring CP at cp = world/dp,
    FSDP2 over dp×cp, ``kv_b`` in FP8 with delayed scaling (``gemms`` of it, emulated), the
    scales updated after each step as ``mt_train`` does (over the TP group, not cp); against
    the same FP8 model on one process. Position :data:`SPIKE` of every sequence holds a token
    of its own whose embedding gives the first block the latent of :func:`spike_latent`. Two
    steps on the same data without an optimizer step; returns the second step's errors of the
    logits, the loss and every gradient (FSDP2's reduced shards, whole), and each ``kv_b``'s
    delayed-scaling history and scales."""
    import dataclasses

    from parallel_checks import VOCAB, _batch, _local_batch, compare_grads
    from toy_lm import PLAN, DecoderLM

    from mt_fp8 import DelayedScaling, update_fp8_scales

    cp = dist.get_world_size() // dp
    state = mt_comm.init_parallel_state(dp=dp, cp=cp)
    spike = VOCAB  # a token id _batch never draws
    model = DecoderLM(VOCAB + 1, FP8_SHAPES["dim"], 2, 4, 2, 64)
    for block in model.layers:
        block.attention = MultiLatentAttention(**FP8_SHAPES, q_lora_rank=16, num_layers=2)
    mp.init_weights(model, 0)
    # The first block's attention norm (weight 1) keeps the embedding's direction.
    row = model.layers[0].attention.kv_a_proj.weight.detach()[0]
    with torch.no_grad():
        model.embed.weight[spike] = 3 * row / row.norm()
    reference = copy.deepcopy(model)
    recipe = DelayedScaling(amax_history_len=4, margin=1)
    fp8 = mp.FP8Options(recipe=recipe, backend="emulate", gemms=gemms)
    plan = dataclasses.replace(PLAN, fp8_skip=FP8_SKIP_BUT_KV_B)
    config = mp.ParallelConfig(cp=cp, dp=dp, cp_attention="ring", data_parallel="fsdp")
    model = mp.parallelize(model, config, state, plan, fp8)
    mp.apply_fp8_options(reference, plan, fp8)
    tokens, targets = _batch(1, 2 * dp, SEQ_CP)
    tokens[:, SPIKE] = spike
    local_tokens, local_targets, positions, rows = _local_batch(state, tokens, targets)
    for _ in range(2):
        for module in (model, reference):
            module.zero_grad(set_to_none=True)
        ref_logits = reference(tokens)
        ref_losses = mp.vocab_parallel_cross_entropy(ref_logits, targets, reduction="none")
        ref_losses.mean().backward()
        logits = model(local_tokens, positions)
        loss = model.loss(logits, local_targets)
        loss.backward()
        update_fp8_scales(model, recipe, state.group("tp"))
        update_fp8_scales(reference, recipe)
    metas = [
        {"history": m.attention.kv_b_proj.fp8_meta.amax_history.clone(),
         "scale": m.attention.kv_b_proj.fp8_meta.scale.clone()}
        for m in (*model.layers, *reference.layers)
    ]  # fmt: skip
    return {
        "logits": rel_err(logits, ref_logits[rows][:, positions]),
        "loss": rel_err(loss, ref_losses[rows][:, positions].mean()),
        "grads": compare_grads(model, reference, 0, 1),
        "fsdp": all(hasattr(p, "full_tensor") for p in model.parameters()),
        "metas": {"ring": metas[:2], "one": metas[2:]},
    }
