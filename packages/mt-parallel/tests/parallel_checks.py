"""Functions run on every rank of a DistributedPool by the mt-parallel multi-process tests.

They live in a plain module (not a test module) so spawned workers import them by name. Each
builds the parallel computation and, on the same rank, a single-process float64 reference with
the same initial weights (same seeds) and data, and returns plain numbers: the largest relative
error ``max|a − b| / max|b|`` per compared tensor. The tests assert on those.

Devices. Every function takes ``device`` (default: the device ``mt_comm.init_distributed`` bound
this process to, so the same function runs on gloo/CPU in the test pools and on NCCL/CUDA under
``benchmarks/multi_gpu/parity.py``). Weights are drawn on the CPU (``mp.init_weights``) and data
from CPU generators, then moved, so every device starts from the same numbers. The reference
always runs on the host CPU in float64: on CUDA, mt-fp8's fused Triton kernels (RMSNorm, RoPE,
SwiGLU) compute in fp32 even for fp64 inputs, so a float64 model on the GPU would not be a
float64 reference. Degrees default to the whole world in the dimension a check is about; the
other ranks of a larger world fill the data-parallel dimension and repeat the check.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from toy_lm import PLAN, DecoderLM

import mt_comm
import mt_parallel as mp

VOCAB, DIM, HEADS, KV_HEADS, FFN = 64, 32, 4, 2, 64


def device_of(device: str | torch.device | None = None) -> torch.device:
    """``device``, or the device this process is bound to (``mt_comm.init_distributed``)."""
    if device is not None:
        return torch.device(device)
    return mt_comm.get_distributed_context().torch_device


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a − b| / max|b|`` in float64 on the CPU (either tensor may live on a device)."""
    if hasattr(actual, "full_tensor"):  # an FSDP2 DTensor: compare the whole parameter
        actual = actual.full_tensor()
    expected = expected.detach().double().cpu()
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual.detach().double().cpu() - expected).abs().max() / scale)


def _strip(name: str) -> str:
    return name.removeprefix("module.")


def compare_grads(
    model: nn.Module, reference: nn.Module, tp_rank: int, tp_size: int
) -> dict[str, float]:
    """Relative error of every parameter gradient against this rank's shard of the reference's."""
    plan = mp.tp_shard_plan(reference)
    full = {name: p.grad for name, p in reference.named_parameters()}
    expected = mp.shard_state_dict(full, plan, tp_rank, tp_size)
    errors = {}
    for name, param in model.named_parameters():
        errors[_strip(name)] = rel_err(param.grad, expected[_strip(name)])
    if set(errors) != set(expected):
        raise AssertionError(f"compared {sorted(errors)} but the reference has {sorted(expected)}")
    return errors


def compare_params(model: nn.Module, reference: nn.Module, tp_rank: int, tp_size: int) -> float:
    plan = mp.tp_shard_plan(reference)
    full = {name: p.detach() for name, p in reference.named_parameters()}
    expected = mp.shard_state_dict(full, plan, tp_rank, tp_size)
    return max(rel_err(p, expected[_strip(n)]) for n, p in model.named_parameters())


# --------------------------------------------------------------------------- TP layers + CE
class _LayerStack(nn.Module):
    """Embedding → column → ReLU → row → (column gather → row scatter) → LM head, all TP."""

    def __init__(self, tp_group: object, sp: bool) -> None:
        super().__init__()
        kw = {"tp_group": tp_group, "sequence_parallel": sp}
        self.embed = mp.VocabParallelEmbedding(VOCAB, DIM, **kw)
        self.up = mp.ColumnParallelLinear(DIM, FFN, bias=True, **kw)
        self.down = mp.RowParallelLinear(FFN, DIM, bias=True, **kw)
        self.sp = sp
        if not sp:  # the gather_output / input_is_parallel=False pair (no SP form)
            self.up2 = mp.ColumnParallelLinear(DIM, FFN, gather_output=True, tp_group=tp_group)
            self.down2 = mp.RowParallelLinear(FFN, DIM, input_is_parallel=False, tp_group=tp_group)
        self.head = mp.ColumnParallelLinear(DIM, VOCAB, bias=False, **kw)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens_BT)
        x = x + self.down(F.relu(self.up(x)))
        if not self.sp:
            x = x + self.down2(torch.tanh(self.up2(x)))
        return self.head(x)


def tp_layers(
    sp: bool, seed: int = 0, tp: int | None = None, cp: int = 1, device: str | None = None
) -> dict[str, object]:
    """Each TP layer and the vocab-parallel CE vs. the tp=1 float64 reference.

    ``tp`` defaults to the world over ``cp``; dp takes the rest of the world.
    """
    dev = device_of(device)
    tp = dist.get_world_size() // cp if tp is None else tp
    state = mt_comm.init_parallel_state(tp=tp, cp=cp)
    tp_group, tp, rank = state.group("tp"), state.size("tp"), state.rank("tp")
    model = _LayerStack(tp_group, sp)
    reference = _LayerStack(None, False)
    mp.init_weights(model, seed)
    mp.init_weights(reference, seed)
    init_err = compare_params(model, reference, rank, tp) if not sp else 0.0
    model = model.to(dev)
    if sp:  # the SP stack has no up2/down2: compare the shared layers
        ref_sp = _LayerStack(None, False)
        mp.init_weights(ref_sp, seed)
        del ref_sp.up2, ref_sp.down2
        ref_sp.sp = True
        reference = ref_sp
        init_err = compare_params(model, reference, rank, tp)
    reference = reference.double()

    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=generator)
    targets = torch.randint(0, VOCAB, (2, 16), generator=generator)
    targets[0, :3] = -100  # ignored tokens

    ref_logits = reference(tokens)
    ref_loss = mp.vocab_parallel_cross_entropy(ref_logits, targets)
    torch_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), targets.reshape(-1))
    ref_loss.backward()

    logits = model(tokens.to(dev))
    loss = mp.vocab_parallel_cross_entropy(logits, targets.to(dev), tp_group)
    loss.backward()
    return {
        "init": init_err,
        "logits": rel_err(logits, ref_logits.chunk(tp, dim=-1)[rank]),
        "loss": rel_err(loss, ref_loss),
        "ce_vs_torch": rel_err(ref_loss, torch_loss),
        "grads": compare_grads(model, reference, rank, tp),
    }


def cp_sequence_mean_ce(seed: int = 0, device: str | None = None) -> dict[str, object]:
    """``sequence_mean_cross_entropy`` at cp=2 (fp64 logits, the cp ranks holding different
    numbers of ignored targets) against the one-process mean: the cp group's mean of the
    shares, the logged mean, the count and the logits' gradient (averaged over cp, as DDP)."""
    dev = device_of(device)
    state = mt_comm.init_parallel_state(cp=2)
    cp_group = state.group("cp")
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 16, VOCAB, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (2, 16), generator=generator)
    targets[0, 10:] = -100  # rank 0 holds positions 12-15 (all ignored), rank 1 none of them
    targets[1, 5] = -100
    reference = logits.clone().requires_grad_(True)
    ref_loss = mp.vocab_parallel_cross_entropy(reference, targets)
    ref_loss.backward()

    local = mp.shard_sequence(logits, 1, cp_group).to(dev).requires_grad_(True)
    result = mp.sequence_mean_cross_entropy(
        local, mp.shard_sequence(targets, 1, cp_group).to(dev), None, cp_group
    )
    # The objective is the cp group's mean of the shares: each rank's part of its gradient is
    # the gradient of its share over cp.
    (result.loss / 2).backward()
    share = result.loss.detach().clone()
    mt_comm.all_reduce(share, op="avg", group=cp_group)
    return {
        "shares": rel_err(share, ref_loss),
        "mean": rel_err(result.mean, ref_loss),
        "grad": rel_err(mp.unshard_sequence(local.grad, 1, cp_group), reference.grad),
        "count": (float(result.count), float((targets != -100).sum())),
    }


# --------------------------------------------------------------------------- CP attention
def cp_attention(
    seed: int = 0, cp: int | None = None, tp: int = 1, device: str | None = None
) -> dict[str, float]:
    """Load-balanced causal GQA attention over ``cp`` ranks (default: the world over ``tp``),
    forward and backward."""
    dev = device_of(device)
    cp = dist.get_world_size() // tp if cp is None else cp
    state = mt_comm.init_parallel_state(cp=cp, tp=tp)
    cp_group = state.group("cp")
    generator = torch.Generator().manual_seed(seed)
    B, T, d = 2, 8 * cp, 8
    q = torch.randn(B, HEADS, T, d, generator=generator, dtype=torch.float64)
    k = torch.randn(B, KV_HEADS, T, d, generator=generator, dtype=torch.float64)
    v = torch.randn(B, KV_HEADS, T, d, generator=generator, dtype=torch.float64)
    dy = torch.randn(B, HEADS, T, d, generator=generator, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    ref_out.backward(dy)

    local = [mp.shard_sequence(t, 2, cp_group).float().to(dev).requires_grad_() for t in (q, k, v)]
    out = mp.context_parallel_attention(*local, cp_group)
    out.backward(mp.shard_sequence(dy, 2, cp_group).float().to(dev))
    errors = {"out": rel_err(out, mp.shard_sequence(ref_out, 2, cp_group))}
    for name, mine, theirs in zip("qkv", local, ref, strict=True):
        errors[f"d{name}"] = rel_err(mine.grad, mp.shard_sequence(theirs.grad, 2, cp_group))
    errors["unshard"] = rel_err(mp.unshard_sequence(out.detach(), 2, cp_group), ref_out)
    return errors


# --------------------------------------------------------------------------- decoder block / LM
def _lm(
    dropout: float = 0.0,
    layers: int = 2,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    moe: mp.moe.MoEConfig | None = None,
) -> DecoderLM:
    return DecoderLM(VOCAB, DIM, layers, heads, kv_heads, FFN, dropout=dropout, moe=moe)


def _batch(seed: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _local_batch(
    state: mt_comm.ParallelState, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice]:
    """This rank's samples (by dp rank) and tokens (load-balanced by cp rank)."""
    dp, dp_rank, cp_group = state.size("dp"), state.rank("dp"), state.group("cp")
    per = tokens.shape[0] // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    seq = tokens.shape[1]
    positions = mp.load_balanced_positions(seq, state.size("cp"), state.rank("cp"))
    return (
        mp.shard_sequence(tokens[rows], 1, cp_group),
        mp.shard_sequence(targets[rows], 1, cp_group),
        positions,
        rows,
    )


def decoder_lm(
    dp: int = 1,
    cp: int = 1,
    tp: int = 1,
    sp: bool = False,
    data_parallel: str = "ddp",
    recompute: str = "none",
    cp_attention: str = "all_gather",
    seed: int = 0,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    device: str | None = None,
) -> dict[str, object]:
    """The decoder LM (2 Llama blocks) under parallelize() vs. the float64 reference.

    ``heads``/``kv_heads`` (width stays ``DIM``) let tp=4 or 8 divide the key/value heads.
    """
    dev = device_of(device)
    config = mp.ParallelConfig(
        tp=tp,
        cp=cp,
        dp=dp,
        sequence_parallel=sp,
        data_parallel=data_parallel,
        recompute=recompute,
        cp_attention=cp_attention,
    )
    state = mt_comm.init_parallel_state(dp=dp, cp=cp, tp=tp)
    reference = _lm(heads=heads, kv_heads=kv_heads)
    mp.init_weights(reference, seed)
    reference = reference.double()
    model = _lm(heads=heads, kv_heads=kv_heads)
    mp.init_weights(model, seed)
    model = mp.parallelize(model.to(dev), config, state, PLAN)

    tokens, targets = _batch(seed + 1, 2 * dp, 16)
    ref_logits = reference(tokens)
    ref_losses = mp.vocab_parallel_cross_entropy(ref_logits, targets, reduction="none")
    ref_losses.mean().backward()

    local_tokens, local_targets, positions, rows = _local_batch(state, tokens, targets)
    logits = model(local_tokens.to(dev), positions.to(dev))
    inner = model.module if hasattr(model, "module") else model
    loss = inner.loss(logits, local_targets.to(dev))
    loss.backward()

    tp_rank = state.rank("tp")
    expected_logits = ref_logits[rows][:, positions].chunk(tp, dim=-1)[tp_rank]
    return {
        "logits": rel_err(logits, expected_logits),
        "loss": rel_err(loss, ref_losses[rows][:, positions].mean()),
        "grads": compare_grads(inner, reference, tp_rank, tp),
    }


# --------------------------------------------------------------------------- data parallel
def dp_accumulation(
    micro_batches: int = 4, seed: int = 0, device: str | None = None
) -> dict[str, object]:
    """dp=world with DDP: ``micro_batches`` accumulated micro-batches equal one large batch.

    ``unreduced``: after the first micro-batch (inside ``accumulate(is_last=False)``) every
    gradient is still this rank's own, compared with a plain copy of the model on the same
    device. The bound is 1e-6 relative, not bit equality, because GPU backward kernels may
    accumulate in a nondeterministic order; a reduced gradient (averaged with another rank's
    different micro-batch) is off by O(1). On the CPU the two are bit-identical.
    """
    dev = device_of(device)
    world = dist.get_world_size()
    state = mt_comm.init_parallel_state(dp=world)
    reference = _lm(layers=1)
    mp.init_weights(reference, seed)
    local_reference = copy.deepcopy(reference).to(dev)
    reference = reference.double()
    model = _lm(layers=1)
    mp.init_weights(model, seed)
    model = mp.parallelize(model.to(dev), mp.ParallelConfig(dp=world), state, PLAN)

    tokens, targets = _batch(seed + 1, world * micro_batches, 16)
    ref_loss = mp.vocab_parallel_cross_entropy(reference(tokens), targets)
    ref_loss.backward()

    rank, per_rank = state.rank("dp"), micro_batches
    first_grads_local = False
    unreduced_err = float("inf")
    for micro in range(micro_batches):
        row = rank * per_rank + micro
        x, y = tokens[row : row + 1].to(dev), targets[row : row + 1].to(dev)
        with mp.accumulate(model, is_last=micro == micro_batches - 1):
            loss = model.module.loss(model(x), y) / micro_batches
            loss.backward()
        if micro == 0:
            # Not reduced yet: the gradient is this rank's own micro-batch's gradient.
            (local_reference.loss(local_reference(x), y) / micro_batches).backward()
            unreduced_err = max(
                rel_err(p.grad, q.grad)
                for p, q in zip(
                    model.module.parameters(), local_reference.parameters(), strict=True
                )
            )
            first_grads_local = unreduced_err < 1e-6
    return {
        "grads": compare_grads(model.module, reference, 0, 1),
        "unreduced": first_grads_local,
        "unreduced_err": unreduced_err,
    }


def zero1_steps(
    steps: int = 3,
    tp: int = 1,
    dtype: str = "float64",
    max_norm: float = 0.05,
    seed: int = 0,
    device: str | None = None,
) -> dict[str, object]:
    """DistributedOptimizer (AdamW, clipping) for ``steps`` vs. plain AdamW on one process.

    In float64 on CUDA, run with ``MT_FP8_DISABLE_TRITON=1``: the fused Triton kernels compute
    in fp32 whatever the input dtype (see the module docstring).
    """
    dev = device_of(device)
    world = dist.get_world_size()
    dp = world // tp
    state = mt_comm.init_parallel_state(dp=dp, tp=tp)
    reference = _lm(layers=1)
    mp.init_weights(reference, seed)
    reference = reference.double()
    model = _lm(layers=1)
    mp.init_weights(model, seed)
    model = model.to(device=dev, dtype=getattr(torch, dtype))
    model = mp.parallelize(
        model, mp.ParallelConfig(tp=tp, dp=dp, data_parallel="zero1"), state, PLAN
    )
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    ref_opt = torch.optim.AdamW(reference.parameters(), **hyper)
    opt = mp.DistributedOptimizer(
        model.parameters(), state.group("dp_cp"), tp_group=state.group("tp"), **hyper
    )
    norms = []
    for step in range(steps):
        tokens, targets = _batch(seed + 10 + step, 2 * dp, 16)
        ref_opt.zero_grad()
        mp.vocab_parallel_cross_entropy(reference(tokens), targets).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_opt.step()
        local_tokens, local_targets, positions, _ = _local_batch(state, tokens, targets)
        opt.zero_grad()
        logits = model(local_tokens.to(dev), positions.to(dev))
        model.loss(logits, local_targets.to(dev)).backward()
        norm = opt.step(max_grad_norm=max_norm)
        norms.append(rel_err(norm, ref_norm))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    (dense,) = opt.partitions  # no experts: one partition over dp×cp
    shard = flat[dense.lo : dense.lo + opt.master.numel()]
    plan = mp.tp_shard_plan(reference)
    expected = mp.shard_state_dict(
        {n: p.detach() for n, p in reference.named_parameters()}, plan, state.rank("tp"), tp
    )
    return {
        "params": compare_params(model, reference, state.rank("tp"), tp),
        "abs_err": max(
            float((p.detach().double().cpu() - expected[n]).abs().max())
            for n, p in model.named_parameters()
        ),
        "max_param": max(float(p.detach().abs().max()) for p in reference.parameters()),
        "params_are_cast_masters": torch.equal(
            shard, opt.master.detach()[: shard.numel()].to(flat.dtype)
        ),
        "lr": hyper["lr"],
        "norms": norms,
        "clipped": bool(ref_norm > max_norm),
        "param_dtype": str(next(model.parameters()).dtype),
        "master_dtype": str(opt.master.dtype),
        "master_numel": opt.master.numel(),
        "total_numel": opt.numel,
    }


def clip_norm(
    tp: int,
    dp: int = 1,
    sp: bool = False,
    data_parallel: str = "ddp",
    seed: int = 0,
    device: str | None = None,
) -> dict[str, object]:
    """clip_grad_norm_ over TP (+DDP over dp) vs. torch's clipping of the reference."""
    dev = device_of(device)
    state = mt_comm.init_parallel_state(dp=dp, tp=tp)
    reference = _lm(layers=1)
    mp.init_weights(reference, seed)
    reference = reference.double()
    model = _lm(layers=1)
    mp.init_weights(model, seed)
    config = mp.ParallelConfig(tp=tp, dp=dp, sequence_parallel=sp, data_parallel=data_parallel)
    model = mp.parallelize(model.to(dev), config, state, PLAN)
    inner = model.module if hasattr(model, "module") else model
    tokens, targets = _batch(seed + 1, 2 * dp, 16)
    mp.vocab_parallel_cross_entropy(reference(tokens), targets).backward()
    max_norm = 0.05
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    local_tokens, local_targets, positions, _ = _local_batch(state, tokens, targets)
    inner.loss(model(local_tokens.to(dev), positions.to(dev)), local_targets.to(dev)).backward()
    norm = mp.clip_grad_norm_(
        model.parameters(), max_norm, tp_group=state.group("tp"), dp_cp_group=state.group("dp_cp")
    )
    return {
        "norm": rel_err(norm, ref_norm),
        "clipped": bool(ref_norm > max_norm),
        "grads": compare_grads(inner, reference, state.rank("tp"), tp),
    }


# --------------------------------------------------------------------------- recompute
def recompute_bits(
    policy: str, tp: int = 1, sp: bool = False, seed: int = 0, device: str | None = None
) -> dict[str, object]:
    """Gradients with ``policy`` are bit-identical to those without (dropout on).

    ``identical``: every gradient bit-equal; ``max_rel``: the largest relative difference (on a
    GPU, a difference at rounding level would point at a nondeterministic kernel, one of
    order 1 at a dropout mask that was not replayed).
    """
    dev = device_of(device)
    state = mt_comm.init_parallel_state(tp=tp, dp=dist.get_world_size() // tp)
    grads = []
    for recompute in ("none", policy):
        model = _lm(dropout=0.1)
        mp.init_weights(model, seed)
        config = mp.ParallelConfig(
            tp=tp,
            dp=state.size("dp"),
            sequence_parallel=sp,
            data_parallel="none",
            recompute=recompute,
            recompute_targets=["attention", "mlp"],
        )
        model = mp.parallelize(model.to(dev), config, state, PLAN)
        tokens, targets = _batch(seed + 1, 2, 16)
        mp.manual_seed(seed + 2, state.rank("tp"))
        model.loss(model(tokens.to(dev)), targets.to(dev)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return {
        "identical": all(torch.equal(a, b) for a, b in zip(*grads, strict=True)),
        "max_rel": max(rel_err(a, b) for a, b in zip(*grads, strict=True)),
    }


# --------------------------------------------------------------------------- bad input
def errors_at_tp2() -> dict[str, str]:
    """Messages raised for shapes that tp=2 / cp=2 cannot split."""
    state = mt_comm.init_parallel_state(tp=2, dp=dist.get_world_size() // 2)
    tp_group = state.group("tp")
    cases = {
        "heads": lambda: mp.apply_tensor_parallel(DecoderLM(VOCAB, 24, 1, 3, 1, FFN), tp_group),
        "kv_heads": lambda: mp.apply_tensor_parallel(DecoderLM(VOCAB, DIM, 1, 4, 1, FFN), tp_group),
        "vocab": lambda: mp.apply_tensor_parallel(
            DecoderLM(33, DIM, 1, HEADS, KV_HEADS, FFN), tp_group
        ),
        "vocab_layer": lambda: mp.VocabParallelEmbedding(33, DIM, tp_group=tp_group),
        "cp_sequence": lambda: mp.shard_sequence(torch.zeros(1, 6), 1, tp_group),
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
        except ValueError as error:
            messages[name] = str(error)
        else:
            messages[name] = "no error"
    return messages


# --------------------------------------------------------------------------- FP8 under TP
# Per-element FP8 quantization error |q(v)·s − v| ≤ rel·|v| + floor·amax: rel is half an ulp
# (E4M3: 3 mantissa bits → 2⁻⁴; E5M2: 2 bits → 2⁻³), floor·amax half the smallest subnormal
# step after scaling amax to the format maximum (E4M3: 2⁻¹⁰/448; E5M2: 2⁻¹⁷/57344).
E4M3 = (2.0**-4, 2.0**-10 / 448)
E5M2 = (2.0**-3, 2.0**-17 / 57344)


def fp8_gemm_bound(
    a_MK: torch.Tensor, b_NK: torch.Tensor, fmt_a: tuple, fmt_b: tuple
) -> torch.Tensor:
    """Elementwise bound on |a bᵀ − q(a) q(b)ᵀ| from the per-element errors above.

    With |δa| ≤ ra|a| + fa and |δb| ≤ rb|b| + fb:
    |ab − (a+δa)(b+δb)| ≤ (ra+rb+ra·rb)|a||b| + (1+ra)·fb·|a| + (1+rb)·fa·|b| + fa·fb, summed
    over K; plus 1e-5 relative for the fp32 accumulation. Using the full tensors' amax for the
    floors bounds every TP shard's (smaller or equal) amax.
    """
    (ra, fa), (rb, fb) = fmt_a, fmt_b
    a, b = a_MK.double().abs(), b_NK.double().abs()
    fa, fb = fa * float(a.max()), fb * float(b.max())
    product = a @ b.T
    return (
        (ra + rb + ra * rb + 1e-5) * product
        + (1 + ra) * fb * a.sum(-1, keepdim=True)
        + (1 + rb) * fa * b.sum(-1).unsqueeze(0)
        + a.shape[1] * fa * fb
    )


def _bound_ratio(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> float:
    error = (
        actual.detach().double().cpu().reshape(bound.shape)
        - expected.detach().cpu().reshape(bound.shape)
    ).abs()
    return float((error / bound).max())


def fp8_tp(
    seed: int = 0,
    tp: int | None = None,
    cp: int = 1,
    backend: str = "emulate",
    device: str | None = None,
) -> dict[str, object]:
    """Column- and row-parallel linears in FP8 (tensorwise; ``backend`` emulate by default) vs.
    the fp64 reference; ``tp`` defaults to the world over ``cp``."""
    from mt_fp8 import DelayedScaling, TensorwiseScaling, update_fp8_scales

    dev = device_of(device)
    tp = dist.get_world_size() // cp if tp is None else tp
    state = mt_comm.init_parallel_state(tp=tp, cp=cp)
    tp_group, tp, rank = state.group("tp"), state.size("tp"), state.rank("tp")
    d_in, d_hidden = 64, 128

    def layers(group: object) -> nn.ModuleDict:
        return nn.ModuleDict(
            {
                "col": mp.ColumnParallelLinear(d_in, d_hidden, gather_output=True, tp_group=group),
                "row": mp.RowParallelLinear(
                    d_hidden, d_in, input_is_parallel=False, tp_group=group
                ),
            }
        )

    model, reference = layers(tp_group), layers(None)
    mp.init_weights(model, seed)
    mp.init_weights(reference, seed)
    reference = reference.double()
    model = model.to(dev)
    mp.apply_fp8(model, TensorwiseScaling(), amax_group=tp_group, backend=backend)
    # The same layers in FP8 at tp=1: with the amaxes of sharded tensors reduced over TP, every
    # shard is quantized with the whole tensor's scale, so TP changes only the summation order.
    fp8_tp1 = layers(None)
    mp.init_weights(fp8_tp1, seed)
    fp8_tp1 = fp8_tp1.to(dev)
    mp.apply_fp8(fp8_tp1, TensorwiseScaling(), backend=backend)

    generator = torch.Generator().manual_seed(seed + 1)
    result: dict[str, object] = {"fp8": all(m.fp8_enabled for m in model.values())}
    for name, width_in, width_out in (("col", d_in, d_hidden), ("row", d_hidden, d_in)):
        x = torch.randn(32, width_in, generator=generator)
        dy = torch.randn(32, width_out, generator=generator)
        x_ref = x.double().requires_grad_()
        y_ref = reference[name](x_ref)
        y_ref.backward(dy.double())
        x1 = x.to(dev, copy=True).requires_grad_()
        y1 = fp8_tp1[name](x1)
        y1.backward(dy.to(dev))
        xd = x.to(dev, copy=True).requires_grad_()
        y = model[name](xd)
        y.backward(dy.to(dev))
        w_ref = reference[name].weight.detach()
        plan = mp.tp_shard_plan(reference[name])
        w_grad = mp.shard_state_dict({"weight": reference[name].weight.grad}, plan, rank, tp)[
            "weight"
        ]
        w_grad1 = mp.shard_state_dict({"weight": fp8_tp1[name].weight.grad}, plan, rank, tp)
        x_local = x if name == "col" else x.chunk(tp, dim=-1)[rank]
        dy_local = dy.chunk(tp, dim=-1)[rank] if name == "col" else dy
        result[name] = {
            "y": _bound_ratio(y, y_ref, fp8_gemm_bound(x, w_ref, E4M3, E4M3)),
            "dx": _bound_ratio(xd.grad, x_ref.grad, fp8_gemm_bound(dy, w_ref.T, E5M2, E4M3)),
            "dw": _bound_ratio(
                model[name].weight.grad, w_grad, fp8_gemm_bound(dy_local.T, x_local.T, E5M2, E4M3)
            ),
            "db": rel_err(
                model[name].bias.grad,
                mp.shard_state_dict({"bias": reference[name].bias.grad}, plan, rank, tp)["bias"],
            ),
            "vs_tp1_fp8": {
                "y": rel_err(y, y1),
                "dx": rel_err(xd.grad, x1.grad),
                "dw": rel_err(model[name].weight.grad, w_grad1["weight"]),
            },
            "not_exact": rel_err(y, y_ref) > 1e-4,
            "y_bytes": y.detach().cpu().clone(),
            "dx_bytes": xd.grad.cpu().clone(),
        }

    # Delayed scaling: after the step's update, every TP rank holds the same scales.
    delayed = DelayedScaling(amax_history_len=4)
    model_delayed = layers(tp_group)
    mp.init_weights(model_delayed, seed)
    model_delayed = model_delayed.to(dev)
    mp.apply_fp8(model_delayed, delayed, amax_group=tp_group, backend=backend)
    x = torch.randn(32, d_in, generator=generator).to(dev)
    model_delayed["row"](model_delayed["col"](x)).sum().backward()
    update_fp8_scales(model_delayed, delayed)
    result["delayed_scales"] = {n: m.fp8_meta.scale.cpu().clone() for n, m in model_delayed.items()}
    return result
