"""Run on every rank of a DistributedPool by test_moe_data_parallel_world4.py: a two-block MoE
model in float64 trained a few AdamW steps (two micro-batches each, global-norm clipping) with
expert parallelism under each data-parallel mode, against the unsplit model on one process;
optionally at ``tp > 1`` with sequence parallel (each TP rank runs its S/tp tokens: the
dense projections and the routed experts are replicated over TP, their gradients summed there).

Each rank builds the same model (same seeds), splits its experts over ``ep``, and trains on its
own tokens; the reference runs every rank's tokens in turn with the loss averaged over the
dp×cp ranks and micro-batches (what the modes' gradient reductions must reproduce), clipped by
torch's ``clip_grad_norm_``. Returns the relative errors of every parameter after the last step,
of every step's gradient norm and of every step's reduced expert gradients (before clipping),
this rank's final parameters (the local experts and the rest, whole) for comparing the modes
with each other, how the mode sharded the experts, and the sizes of the all-reduces over TP
that carried expert gradients in each step (the TP sum under sequence parallel: one per step).

With ``fp8`` (one recipe name per block) both models run their experts through
``mt_fp8.FP8GroupedLinear`` (the dense projections stay float64), and every FP8 weight operand
each side hands a GEMM is recorded: the shape of the weight it was quantized from, whether it
went through a weight cache, and the scales of ``w`` and ``wᵀ``; this rank's forwards are
compared call by call with the reference's forwards of the same tokens. ``steps`` (at most
``STEPS``) shortens a run: FP8 layers on the CPU cost several times the float64 ones.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_checks import rel_err
from torch import nn

import mt_comm
import mt_fp8
import mt_parallel as mp
from mt_fp8.linear_plan import LinearPlan
from mt_parallel.mappings import copy_to_group, group_size
from mt_parallel.moe import MoE, MoEConfig, apply_expert_parallel, collect_aux_losses

DIM, BATCH, SEQ, STEPS, MICRO = 16, 2, 6, 3, 2
LR, MAX_NORM = 1e-2, 0.05


class Block(nn.Module):
    """A dense projection, then an MoE feed-forward with a residual. Under sequence parallel
    the projection is replicated over TP and runs on this rank's tokens, so its gradients are
    summed over TP (``copy_to_group``, as the SP norms do)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.moe = MoE(DIM, cfg)
        self.sequence_group = None

    def set_tensor_parallel(self, tp_group: object, sequence_parallel: bool) -> None:
        self.sequence_group = tp_group if sequence_parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_group(self.proj.weight, self.sequence_group)
        bias = copy_to_group(self.proj.bias, self.sequence_group)
        h = F.linear(x, weight, bias)
        return h + self.moe(h)


class TwoBlocks(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(cfg), Block(cfg)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _loss(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    y = model(x)
    aux, _ = collect_aux_losses(model)
    return (y * g).sum() + aux


def _whole(param: torch.Tensor) -> torch.Tensor:
    full = param.full_tensor() if hasattr(param, "full_tensor") else param
    return full.detach().clone()


@contextlib.contextmanager
def _all_reduce_sizes(group: object) -> Iterator[list[int]]:
    """Record the element count of every all-reduce over ``group`` while inside (torch's
    collective, which mt_comm and the autograd mappings call, is wrapped and put back)."""
    sizes: list[int] = []
    original = dist.all_reduce

    def recording(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        if kwargs.get("group") is group:
            sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        yield sizes
    finally:
        dist.all_reduce = original


@contextlib.contextmanager
def _fp8_weights_seen(into: list[tuple]) -> Iterator[None]:
    """Append (the weight's shape, whether a weight cache is in use, the scales of its FP8
    ``w`` and ``wᵀ``) for every FP8 weight operand a GEMM gets while inside, quantized or from
    the cache (mt_fp8's ``LinearPlan.weight_operands``, wrapped and put back)."""
    original = LinearPlan.weight_operands

    def recording(plan: LinearPlan, weight_NK: torch.Tensor, need_transpose: bool) -> tuple:
        weight_q, weight_t_q = original(plan, weight_NK, need_transpose)
        scales = [q.scale.clone() for q in (weight_q, weight_t_q) if q is not None]
        into.append((tuple(weight_NK.shape), plan.weight_cache is not None, *scales))
        return weight_q, weight_t_q

    LinearPlan.weight_operands = recording
    try:
        yield
    finally:
        LinearPlan.weight_operands = original


def _fp8_weight_differences(ours: list[tuple], theirs: list[tuple]) -> dict:
    """The weight shapes this rank's FP8 GEMMs were quantized from, whether they used weight
    caches, and the largest relative error of their scales against the reference's, call by
    call (same tokens and routing: the same experts in the same order); a scale of another
    shape counts as an infinite error."""
    assert len(ours) == len(theirs) > 0, (len(ours), len(theirs))
    errors = [
        rel_err(mine, want) if mine.shape == want.shape else math.inf
        for seen, expected in zip(ours, theirs, strict=True)
        for mine, want in zip(seen[2:], expected[2:], strict=True)
    ]
    return {
        "fp8_weight_shapes": sorted({seen[0] for seen in ours}),
        "fp8_weight_cached": sorted({seen[1] for seen in ours}),
        "fp8_scales": max(errors),
    }


def _expert_grad_error(
    model: nn.Module, reference: nn.Module, optimizer: object, mode: str, expert: int, local: int
) -> float:
    """The largest relative error of this rank's reduced expert gradients (ZeRO-1: its shard of
    them) against the reference's gradients of the same experts; 0 at ep = 1, where the experts
    are ordinary parameters (checked with the others through the parameters after the steps)."""
    expected = dict(reference.named_parameters())

    def want(name: str) -> torch.Tensor:
        return expected[name].grad[expert * local : (expert + 1) * local]

    names = {id(p): n for n, p in model.named_parameters() if mp.is_expert_parameter(p)}
    if mode != "zero1":
        experts = [(n, p) for n, p in model.named_parameters() if id(p) in names]
        return max((rel_err(p.grad, want(n)) for n, p in experts), default=0.0)
    grad = optimizer._reduced[0]  # the reduced shard, before apply_update clips it
    errors = []
    for param, start, where in optimizer.shard_slices():
        if id(param) in names:
            ref = want(names[id(param)]).reshape(-1)[start : start + where.stop - where.start]
            errors.append(rel_err(grad[where], ref))
    return max(errors, default=0.0)


def train_steps(
    mode: str,
    ep: int = 2,
    num_experts: int = 8,
    tp: int = 1,
    fp8: tuple[str, ...] | None = None,
    steps: int = STEPS,
) -> dict:
    state = mt_comm.init_parallel_state(tp=tp, ep=ep)
    cfg = MoEConfig(num_experts=num_experts, top_k=2, expert_ffn_dim=16)
    torch.manual_seed(0)
    model = TwoBlocks(cfg).double()
    for i, block in enumerate(model.blocks):
        mp.init_weights(block.moe, seed=3 + i)
        with torch.no_grad():
            block.moe.router.weight.mul_(25)  # spread the scores: ties must not decide routing
    reference = copy.deepcopy(model)
    dp_cp, tp_group, tp_rank = state.group("dp_cp"), state.group("tp"), state.rank("tp")
    if tp > 1:
        mp.apply_tensor_parallel(model, tp_group, sequence_parallel=True)
    apply_expert_parallel(model, state.group("ep"), state.group("edp"), dp_cp)
    if fp8 is not None:  # FP8 before data parallel, as parallelize orders them
        for net in (model, reference):
            for block, recipe in zip(net.blocks, fp8, strict=True):
                mp.apply_fp8(block, mt_fp8.recipe_from_name(recipe))
    wrapped = mp.apply_data_parallel(model, mode, dp_cp, "cpu", (Block,))
    if mode == "zero1":
        optimizer = mp.DistributedOptimizer(model.parameters(), dp_cp, tp_group, lr=LR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)

    ranks, rank = state.size("dp_cp"), state.rank("dp_cp")
    gen = torch.Generator().manual_seed(7)
    shape = (STEPS, MICRO, ranks, BATCH, SEQ, DIM)
    xs = torch.randn(shape, generator=gen, dtype=torch.float64)
    gs = torch.randn(shape, generator=gen, dtype=torch.float64)

    def mine(full: torch.Tensor) -> torch.Tensor:  # this TP rank's tokens of each sequence
        return full.chunk(tp, dim=1)[tp_rank]

    # Under SP an all-reduce over TP at least as large as this rank's smallest expert gradient
    # (a shard under FSDP2) carries expert gradients: every other parameter is smaller (checked;
    # it holds for the SP configurations run, not for FSDP2's small dim-1 shards, run at tp = 1).
    # At tp = 1 nothing is summed over TP and nothing is recorded.
    recording, threshold = contextlib.nullcontext([]), 0
    if tp > 1:
        threshold = min(
            getattr(p, "to_local", lambda p=p: p)().numel()
            for p in model.parameters()
            if mp.is_expert_parameter(p)
        )
        dense = max(p.numel() for p in model.parameters() if not mp.is_expert_parameter(p))
        assert dense < threshold, (dense, threshold)
        recording = _all_reduce_sizes(tp_group)
    local = cfg.num_experts // ep
    norms, clipped, expert_grads, expert_tp_all_reduces = [], [], [], []
    fp8_ours: list[tuple] = []
    fp8_theirs: list[tuple] = []
    with recording as tp_sizes:
        for step in range(steps):
            tp_sizes.clear()
            for micro in range(MICRO):
                x, g = mine(xs[step, micro, rank]), mine(gs[step, micro, rank])
                with (
                    mp.accumulate(wrapped, is_last=micro == MICRO - 1),
                    _fp8_weights_seen(fp8_ours),
                ):
                    (_loss(wrapped, x, g) / MICRO).backward()
            for micro in range(MICRO):
                for r in range(ranks):
                    with _fp8_weights_seen(fp8_theirs if r == rank else []):
                        loss = _loss(reference, xs[step, micro, r], gs[step, micro, r])
                    (loss / (MICRO * ranks)).backward()
            if mode == "zero1":
                optimizer.reduce_gradients()
            expert_grads.append(
                _expert_grad_error(model, reference, optimizer, mode, state.rank("ep"), local)
            )
            if mode == "zero1":
                norm = optimizer.apply_update(MAX_NORM)
            else:
                norm = mp.clip_grad_norm_(list(model.parameters()), MAX_NORM, tp_group, None, dp_cp)
                optimizer.step()
            optimizer.zero_grad()
            expert_tp_all_reduces.append([n for n in tp_sizes if n >= threshold])

            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            norms.append(rel_err(norm, ref_norm))
            clipped.append(bool(ref_norm > MAX_NORM))

    expected = dict(reference.named_parameters())
    errors, final = {}, {}
    for name, param in model.named_parameters():
        want = expected[name]
        if mp.is_expert_parameter(param):
            e = state.rank("ep")
            want = want[e * local : (e + 1) * local]
        final[name] = _whole(param)
        errors[name] = rel_err(final[name], want)
    expert = model.blocks[0].moe.experts.gate_proj.weight
    sharding = {
        "expert_local_shape": list(getattr(expert, "to_local", lambda: expert)().shape),
        "expert_shard_dims": [p.dim for p in getattr(expert, "placements", ())],
        "partition_groups": [group_size(p.group) for p in optimizer.partitions]
        if mode == "zero1"
        else [],
    }
    tp_sums = {
        "expert_tp_all_reduces": expert_tp_all_reduces,
        "expert_numel": sum(p.numel() for p in model.parameters() if mp.is_expert_parameter(p)),
        "edp": state.size("edp"),
    }
    fp8_weights = _fp8_weight_differences(fp8_ours, fp8_theirs) if fp8 is not None else {}
    return {
        "params": errors, "norms": norms, "clipped": clipped, "final": final,
        "expert_grads": expert_grads, **sharding, **tp_sums, **fp8_weights,
    }  # fmt: skip


def ddp_reduced_expert_names(fp8: bool) -> list[str]:
    """The expert parameters (by name) whose gradients DDP changed in the backward, with the
    experts split over ep=2 and, with ``fp8``, run through ``FP8GroupedLinear`` (which holds
    the same weight under a second name): each rank backpropagates its own tokens through the
    DDP-wrapped model and through an unwrapped copy; an expert gradient that DDP reduced differs
    from the copy's (other ranks hold other experts)."""
    state = mt_comm.init_parallel_state(ep=2)
    models = []
    for _ in range(2):  # the same model twice (same seed, same transforms)
        torch.manual_seed(0)
        model = TwoBlocks(MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=16))
        apply_expert_parallel(model, state.group("ep"), state.group("edp"), state.group("dp_cp"))
        if fp8:
            mp.apply_fp8(model)
        models.append(model)
    model, plain = models
    wrapped = mp.apply_data_parallel(model, "ddp", state.group("dp_cp"), "cpu", (Block,))
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(state.rank("dp_cp")))
    for net in (wrapped, plain):
        net(x).square().sum().backward()
    plain_grads = dict(plain.named_parameters())
    return sorted(
        name
        for name, p in model.named_parameters()
        if mp.is_expert_parameter(p) and not torch.equal(p.grad, plain_grads[name].grad)
    )
