"""Functions run on every rank of a DistributedPool by the MLA tensor-parallel tests.

Each rank builds the same full MLA layer (same seed), shards it over ``tp`` with
:func:`mt_parallel.apply_tensor_parallel`, and runs the same tokens; the reference is the
unsharded layer on one process. Returns the largest relative errors of the output and of every
gradient (a sharded parameter against its slice of the full gradient). :func:`cp_parity` does
the same under context parallelism (× tp) and also counts what crosses the cp group.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from parallel_checks import rel_err

import mt_comm
import mt_parallel as mp
from mt_parallel.mla import MultiLatentAttention
from mt_parallel.yarn import YarnConfig

SHAPES = {"dim": 32, "num_heads": 4, "kv_lora_rank": 12, "qk_nope_head_dim": 8,
          "qk_rope_head_dim": 6, "v_head_dim": 10}  # fmt: skip
# FP8 GEMMs need every (local) GEMM side divisible by 16 at tp=1 and tp=2.
FP8_SHAPES = {"dim": 32, "num_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 16, "v_head_dim": 8}  # fmt: skip


def tp_parity(tp: int, q_lora_rank: int | None) -> dict:
    state = mt_comm.init_parallel_state(tp=tp)
    yarn = YarnConfig(factor=40.0, original_max_position=16, mscale_all_dim=1.0)
    layer = MultiLatentAttention(**SHAPES, q_lora_rank=q_lora_rank, yarn=yarn).double()
    mp.init_weights(layer, seed=5)
    reference = copy.deepcopy(layer)
    mp.apply_tensor_parallel(layer, state.group("tp"))
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 8, SHAPES["dim"], generator=gen, dtype=torch.float64)
    g = torch.randn(2, 8, SHAPES["dim"], generator=gen, dtype=torch.float64)
    positions = torch.arange(8) + 20
    x_local, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(x_local, positions)
    (y * g).sum().backward()
    expected = reference(x_ref, positions)
    (expected * g).sum().backward()
    full = {n: p.grad for n, p in reference.named_parameters()}
    shards = mp.shard_state_dict(full, mp.tp_shard_plan(reference), state.rank("tp"), tp)
    grads = {name: rel_err(p.grad, shards[name]) for name, p in layer.named_parameters()}
    return {"y": rel_err(y, expected), "x_grad": rel_err(x_local.grad, x_ref.grad),
            "grads": grads}  # fmt: skip


def sp_parity(tp: int, q_lora_rank: int | None) -> dict:
    """The fp32 layer at ``tp`` with sequence parallel (each rank given its S/tp tokens) against
    the fp64 layer on one process, and against the fp32 layer at ``tp`` without SP."""
    state = mt_comm.init_parallel_state(tp=tp)
    group, rank = state.group("tp"), state.rank("tp")
    yarn = YarnConfig(factor=40.0, original_max_position=16, mscale_all_dim=1.0)
    reference = MultiLatentAttention(**SHAPES, q_lora_rank=q_lora_rank, yarn=yarn).double()
    mp.init_weights(reference, seed=5)
    sequence_parallel = mp.apply_tensor_parallel(
        copy.deepcopy(reference).float(), group, sequence_parallel=True
    )
    tensor_parallel = mp.apply_tensor_parallel(copy.deepcopy(reference).float(), group)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 8, SHAPES["dim"], generator=gen, dtype=torch.float64)
    g = torch.randn(2, 8, SHAPES["dim"], generator=gen, dtype=torch.float64)
    positions = torch.arange(8) + 20
    x_ref = x.clone().requires_grad_()
    expected = reference(x_ref, positions)
    (expected * g).sum().backward()
    x_tp = x.float().requires_grad_()
    y_tp = tensor_parallel(x_tp, positions)
    (y_tp * g.float()).sum().backward()
    x_sp = x.float().chunk(tp, dim=1)[rank].requires_grad_()
    y_sp = sequence_parallel(x_sp, positions)
    (y_sp * g.float().chunk(tp, dim=1)[rank]).sum().backward()

    def mine(full: torch.Tensor) -> torch.Tensor:
        return full.chunk(tp, dim=1)[rank]

    full = {n: p.grad for n, p in reference.named_parameters()}
    shards = mp.shard_state_dict(full, mp.tp_shard_plan(reference), rank, tp)
    tp_grads = dict(tensor_parallel.named_parameters())
    sp_params = dict(sequence_parallel.named_parameters())
    return {
        "y": rel_err(y_sp, mine(expected)),
        "x_grad": rel_err(x_sp.grad, mine(x_ref.grad)),
        "grads": {name: rel_err(p.grad, shards[name]) for name, p in sp_params.items()},
        "y_vs_tp": rel_err(y_sp, mine(y_tp)),
        "x_grad_vs_tp": rel_err(x_sp.grad, mine(x_tp.grad)),
        "grads_vs_tp": {n: rel_err(p.grad, tp_grads[n].grad) for n, p in sp_params.items()},
    }


def fp8_sp_parity(tp: int, q_lora_rank: int | None) -> dict:
    """The layer in FP8 (current tensorwise scaling, emulated) at ``tp`` with sequence parallel
    against the same FP8 layer on one process; both fp32."""
    from mt_fp8 import TensorwiseScaling

    state = mt_comm.init_parallel_state(tp=tp)
    group, rank = state.group("tp"), state.rank("tp")
    reference = MultiLatentAttention(**FP8_SHAPES, q_lora_rank=q_lora_rank)
    mp.init_weights(reference, seed=5)
    layer = mp.apply_tensor_parallel(copy.deepcopy(reference), group, sequence_parallel=True)
    mp.apply_fp8(layer, TensorwiseScaling(), amax_group=group, backend="emulate")
    mp.apply_fp8(reference, TensorwiseScaling(), backend="emulate")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 8, FP8_SHAPES["dim"], generator=gen)
    g = torch.randn(2, 8, FP8_SHAPES["dim"], generator=gen)
    x_ref = x.clone().requires_grad_()
    expected = reference(x_ref, None)
    (expected * g).sum().backward()
    x_sp = x.chunk(tp, dim=1)[rank].requires_grad_()
    y = layer(x_sp, None)
    (y * g.chunk(tp, dim=1)[rank]).sum().backward()
    full = {n: p.grad for n, p in reference.named_parameters()}
    shards = mp.shard_state_dict(full, mp.tp_shard_plan(reference), rank, tp)
    linears = [m for m in layer.modules() if isinstance(m, mp.ReplicatedLinear)]
    return {
        "fp8": bool(linears) and all(m.fp8_enabled for m in linears),
        "y": rel_err(y, expected.chunk(tp, dim=1)[rank]),
        "x_grad": rel_err(x_sp.grad, x_ref.grad.chunk(tp, dim=1)[rank]),
        "grads": {name: rel_err(p.grad, shards[name]) for name, p in layer.named_parameters()},
    }


# ----------------------------------------------------------------------- context parallelism
SEQ_CP = 16
"""At cp=2 four chunks of 4: rank 0 holds positions 0-3 and 12-15, rank 1 positions 4-11."""


@contextlib.contextmanager
def cp_traffic(cp_group: Any) -> Iterator[dict[str, list[int]]]:
    """Record the elements of every floating-point tensor handed to ``mt_comm.all_gather``
    (its input) and ``mt_comm.reduce_scatter`` (its input) on ``cp_group`` while inside (the
    differentiable gathers of :mod:`mt_parallel.mappings` call these two)."""
    seen: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}
    originals = {name: getattr(mt_comm, name) for name in seen}

    def wrap(name: str) -> Any:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if kwargs.get("group") is cp_group and tensor.is_floating_point():
                seen[name].append(tensor.numel())
            return originals[name](tensor, *args, **kwargs)

        return counted

    for name in seen:
        setattr(mt_comm, name, wrap(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(mt_comm, name, original)


def cp_parity(
    tp: int = 1,
    q_lora_rank: int | None = None,
    kernel: str | None = None,
    ring: bool = False,
    sp: bool = False,
    fp8_gemms: tuple[str, ...] = (),
    recompute: str = "none",
) -> dict:
    """The layer at cp = world/tp (× tp, with SP if ``sp``) against the same layer on one
    process, each rank fed its load-balanced chunks, their global positions and (``kernel``:
    ``explicit`` or ``flex``) document ids, against which the reference runs every document on
    its own. float64, or float32 with the ``fp8_gemms`` of
    ``kv_b_proj`` in FP8 (tensorwise, emulated; everything else high precision on both sides).
    ``recompute``: the layer's recompute policy (``selective``: the attention core, which then
    receives the gathered K/V as a checkpointed input). Parameter gradients are summed over cp
    (as data parallelism over dp×cp does) before the comparison. Also returns the elements this
    rank handed to the cp group's all-gathers and reduce-scatters (``cp_traffic``) and its token
    count."""
    from sequence_checks import document_ids, flex_backward_on_cpu, runs

    cp = dist.get_world_size() // tp
    state = mt_comm.init_parallel_state(cp=cp, tp=tp)
    cp_group, tp_group = state.group("cp"), state.group("tp")
    shapes = FP8_SHAPES if fp8_gemms else SHAPES
    dtype = torch.float32 if fp8_gemms else torch.float64
    yarn = YarnConfig(factor=40.0, original_max_position=16, mscale_all_dim=1.0)
    reference = MultiLatentAttention(**shapes, q_lora_rank=q_lora_rank, yarn=yarn).to(dtype)
    mp.init_weights(reference, seed=5)
    layer = copy.deepcopy(reference)
    if tp > 1:
        mp.apply_tensor_parallel(layer, tp_group, sequence_parallel=sp)
    mp.apply_context_parallel(layer, cp_group, ring=ring)
    if kernel is not None:
        mp.apply_document_mask_kernel(layer, kernel)
    mp.apply_recompute(layer, recompute)
    if fp8_gemms:
        from mt_fp8 import TensorwiseScaling

        for module in (reference, layer):
            module.kv_b_proj.enable_fp8(TensorwiseScaling(), backend="emulate", fp8_gemms=fp8_gemms)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, SEQ_CP, shapes["dim"], generator=gen, dtype=dtype)
    g = torch.randn(2, SEQ_CP, shapes["dim"], generator=gen, dtype=dtype)
    ids = None if kernel is None else document_ids(3, 2, SEQ_CP)
    positions = torch.arange(SEQ_CP) + 20
    x_ref = x.clone().requires_grad_()
    if ids is None:
        expected = reference(x_ref, positions)
    else:  # every document on its own: no masking code shared with the layer under test
        rows = [
            torch.cat([reference(x_ref[b : b + 1, doc], positions[doc]) for doc in runs(ids[b])], 1)
            for b in range(x.shape[0])
        ]
        expected = torch.cat(rows)
    (expected * g).sum().backward()

    def mine(full: torch.Tensor) -> torch.Tensor:
        """This rank's tokens: its cp chunks, under SP its tp slice of them."""
        local = mp.shard_sequence(full, 1, cp_group)
        return local.chunk(tp, dim=1)[state.rank("tp")] if sp else local

    x_local = mine(x).requires_grad_()
    lift = flex_backward_on_cpu() if kernel == "flex" else contextlib.nullcontext()
    with cp_traffic(cp_group) as traffic, lift:
        y = layer(
            x_local,
            mp.shard_sequence(positions, 0, cp_group),
            None if ids is None else mp.shard_sequence(ids, 1, cp_group),
        )
        (y * mine(g)).sum().backward()
    full = {n: p.grad for n, p in reference.named_parameters()}
    shards = mp.shard_state_dict(full, mp.tp_shard_plan(reference), state.rank("tp"), tp)
    grads = {
        name: rel_err(mt_comm.all_reduce(p.grad.clone(), group=cp_group), shards[name])
        for name, p in layer.named_parameters()
    }
    return {
        "y": rel_err(y, mine(expected)),
        "x_grad": rel_err(x_local.grad, mine(x_ref.grad)),
        "grads": grads,
        "traffic": traffic,
        "tokens": 2 * SEQ_CP // cp,
        "cp": cp,
    }


def check_latent_traffic(result: dict, shapes: dict) -> None:
    """Assert (and drop from ``result``) what :func:`cp_parity` saw cross the cp group:
    all-gather context parallelism moves MLA's latent ``[c ; RoPE(k_rot)]``, C + R values per
    token, and nothing else in floating point, in one all-gather of this rank's tokens forward
    and one reduce-scatter of the whole sequence's latent gradient backward (the expanded K/V
    are heads·(E + V) values per token, per TP rank heads/tp, in two of each)."""
    width = shapes["kv_lora_rank"] + shapes["qk_rope_head_dim"]
    tokens, cp = result.pop("tokens"), result.pop("cp")
    assert result.pop("traffic") == {
        "all_gather": [tokens * width],
        "reduce_scatter": [cp * tokens * width],
    }
