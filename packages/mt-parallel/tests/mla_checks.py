"""Functions run on every rank of a DistributedPool by the MLA tensor-parallel tests.

Each rank builds the same full MLA layer (same seed), shards it over ``tp`` with
:func:`mt_parallel.apply_tensor_parallel`, and runs the same tokens; the reference is the
unsharded layer on one process. Returns the largest relative errors of the output and of every
gradient (a sharded parameter against its slice of the full gradient).
"""

from __future__ import annotations

import copy

import torch
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
