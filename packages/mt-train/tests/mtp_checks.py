"""Worker function for DeepSeek-V3's multi-token prediction under context parallelism (spawned
gloo ranks).

:func:`mtp_cp_step` builds a tiny DeepSeek-V3 in float64 twice from one seed: a one-process
reference fed the whole micro-batch of packed documents, and the model under
``mt_parallel.parallelize`` fed what mt-train's ``BatchRunner`` feeds a cp rank: its
load-balanced chunks, their global positions and document ids, and the model's
``sequence_inputs`` (the shifted tokens and MTP targets of the whole sequence) cut the same
way (and, with tensor parallelism, its vocabulary and head shards). It returns each rank's
errors against the reference: the main loss, every ``mtp_loss_k`` and every parameter
gradient.

:func:`mtp_pp_step` does the same at pp=2 through mt-train's
:class:`~mt_train.pipeline_step.PipelineStep`: the MTP modules and a copy of the embedding on
the last stage (under the V schedules, the one embedding of the rank holding the first and
last chunks), micro-batches with unequal loss factors, then AdamW steps; with dp > 1 (under
FSDP2, say) against one process running every dp rank's micro-batches.
"""

from __future__ import annotations

import dataclasses

import torch

import mt_comm
import mt_parallel as mp
from mt_comm.testing import whole_tensor
from mt_parallel.pipeline import chunks_per_rank
from mt_train.checkpoint.checkpointer import TPLayout, shard_tensors
from mt_train.checkpoint.state import StateLayout, live_state
from mt_train.data.dataset import Batch
from mt_train.models import model_sizes
from mt_train.models.deepseek_v3 import DeepSeekV3, deepseek_plan
from mt_train.models.llama.parallelize import llama_plan
from mt_train.pipeline_step import PipelineStep
from mt_train.step import BatchRunner

# float64: cp=2 (× tp) differs from one process only in summation order (the cp ranks' loss
# sums, the all-gathered or ring attention, TP partial sums, DDP's gradient average), ~1e-16
# relative per operation over a few hundred terms; 1e-10 leaves a wide margin, while a shifted
# token or target taken from the wrong chunk (tried: the loss off by 1.3e-4) or a per-rank
# mean instead of the whole sequence's (the ranks' valid MTP targets differ in number; tried:
# 2.3e-5) moves the loss by orders of magnitude more.
FP64_BOUND = 1e-10
VOCAB = 96
SEQ = 32
"""At cp=2 four chunks of 8: rank 0 holds positions 0-7 and 24-31, rank 1 positions 8-23."""
DOCUMENTS = (
    # Row 0: boundaries at 8 (a chunk boundary: the shifted tokens of positions 6 and 7 on
    # rank 0 are rank 1's) and at 19 (inside rank 1's chunk 2), and a document from 27 (on
    # rank 0's last chunk); row 1: one document, so the masked tail is the only cut.
    [0] * 8 + [1] * 11 + [2] * 8 + [3] * 5,
    [0] * SEQ,
)
IGNORED = ((0, 12), (1, 25))
"""Targets set to ``-100``: each must stay ignored at every depth that reads it."""


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-30) -> float:
    """``max|a − b| / max(max|b|, floor)`` in float64."""
    expected = expected.detach().double()
    scale = expected.abs().max().clamp_min(floor)
    return float((actual.detach().double() - expected).abs().max() / scale)


def tiny_config(depth: int):
    """deepseek_v3_tiny's routing (sigmoid, groups, aux-loss-free, a shared expert) at small
    widths, with ``depth`` MTP modules and λ = 0.3."""
    base = model_sizes()["deepseek_v3_tiny"]
    cfg = dataclasses.replace(
        base, vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, q_lora_rank=16, kv_lora_rank=8,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, ffn_dim=64, dropout=0.0,
        mtp_depth=depth,
    )  # fmt: skip
    cfg.moe = dataclasses.replace(base.moe, expert_ffn_dim=16)
    return cfg


def packed_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, next-token targets (a few ignored) and document ids ``(2, SEQ)``."""
    stream = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    tokens, targets = stream[:, :-1], stream[:, 1:].clone()
    for row, position in IGNORED:
        targets[row, position] = -100
    return tokens, targets, torch.tensor(DOCUMENTS)


def mtp_cp_step(
    depth: int, cp_attention: str = "all_gather", tp: int = 1, seed: int = 0
) -> dict[str, object]:
    """One forward and backward at cp=2 (× ``tp``) against the one-process reference (module
    docstring), the attention's K/V all-gathered or passed around the ring (``cp_attention``);
    under TP each rank's gradients are compared with its shard of the reference's."""
    state = mt_comm.init_parallel_state(cp=2, tp=tp)
    cp_group, cp_rank, tp_rank = state.group("cp"), state.rank("cp"), state.rank("tp")
    cfg = tiny_config(depth)
    reference = DeepSeekV3(cfg)
    mp.init_weights(reference, seed)
    reference = reference.double().train()
    model = DeepSeekV3(cfg)
    mp.init_weights(model, seed)
    model = mp.parallelize(
        model.double(),
        mp.ParallelConfig(tp=tp, cp=2, cp_attention=cp_attention),
        state,
        llama_plan(cfg),
    )
    inner = model.module if hasattr(model, "module") else model  # DDP over cp
    inner.train()

    tokens, targets, docs = packed_batch(seed + 1)
    ref_loss, ref_logged = reference.loss(reference(tokens, None, docs), targets)
    ref_loss.backward()

    derived = inner.sequence_inputs(tokens, targets, docs)
    local = {k: mp.shard_sequence(v, 1, cp_group) for k, v in derived.items()}
    local_tokens, local_targets, local_docs = (
        mp.shard_sequence(x, 1, cp_group) for x in (tokens, targets, docs)
    )
    positions = mp.load_balanced_positions(SEQ, 2, cp_rank)
    try:  # shifting this rank's chunks would read the wrong tokens: refused
        inner(local_tokens, positions, local_docs)
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    loss, logged = inner.loss(model(local_tokens, positions, local_docs, **local), local_targets)
    loss.backward()  # DDP averages the gradients over cp

    mean_loss = loss.detach().clone()
    mt_comm.all_reduce(mean_loss, op="avg", group=cp_group)
    mean_ce = logged["ce_loss"].clone()  # this rank's mean over its T/cp tokens
    mt_comm.all_reduce(mean_ce, op="avg", group=cp_group)
    counts = [int((local["mtp_targets_BTK"][..., k] != -100).sum()) for k in range(depth)]
    grads: dict[str, float] = {}
    ref_params = dict(reference.named_parameters())
    full = {
        name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in ref_params.items()
    }
    expected = mp.shard_state_dict(full, mp.tp_shard_plan(reference), tp_rank, tp)
    floor = 1e-6 * max(float(g.abs().max()) for g in full.values())
    for name, p in inner.named_parameters():
        got = torch.zeros_like(p) if p.grad is None else p.grad
        grads[name] = rel_err(got, expected[name], floor)
    return {
        "loss": rel_err(mean_loss, ref_loss),
        "ce_loss": rel_err(mean_ce, ref_logged["ce_loss"]),
        "mtp": [
            rel_err(logged[f"mtp_loss_{k}"], ref_logged[f"mtp_loss_{k}"])
            for k in range(1, depth + 1)
        ],
        "mtp_keys": sorted(k for k in logged if k.startswith("mtp_loss_")),
        "grads": grads,
        "params": sorted(ref_params),
        "counts": counts,
        "refusal": refusal,
    }


CP_MEANS = ("loss", "ce_loss")
"""Values each cp rank computes over its own tokens: their mean over cp is one process's."""


def mtp_pp_step(
    depth: int,
    schedule: str = "1f1b",
    steps: int = 2,
    cp: int = 1,
    seed: int = 0,
    dp: int = 1,
    data_parallel: str | None = None,
) -> dict[str, object]:
    """``steps`` float64 AdamW steps at pp=2 (``deepseek_plan``: block 0 on stage 0, block 1,
    the MTP modules, the head and an embedding copy on stage 1) against the one-process
    accumulation loop, each dp rank's micro-batches of packed documents with loss factors 1
    and 0.5 in turn (two, four under DualPipeV, whose minimum is 2·pp): the first step's
    errors of the total loss, every logged extra this rank reports (the MTP losses included)
    and every gradient this rank holds (the embedding's on both ranks; whole under FSDP2);
    after the last step, whether the two embeddings are equal bit for bit. With ``cp = 2``
    each rank runs its load-balanced chunks (the runner's cut, the MTP inputs shifted on the
    whole sequence) and its loss and cross-entropy are averaged over cp before comparing; the
    MoE statistics, which are per rank's tokens, are not compared then. With ``dp > 1`` the
    reference runs every dp rank's micro-batches and its loss and extras are compared over
    this rank's. ``data_parallel`` defaults to ``ddp`` at cp > 1, else ``none``."""
    state = mt_comm.init_parallel_state(pp=2, cp=cp, dp=dp)
    cfg = tiny_config(depth)
    if chunks_per_rank(schedule, 1) > 1:  # V schedules: four chunks, a block each
        cfg = dataclasses.replace(cfg, n_layers=4)
    reference, model = DeepSeekV3(cfg), DeepSeekV3(cfg)
    for m in (reference, model):
        mp.init_weights(m, seed)
    reference = reference.double().train()
    microbatches = 4 if schedule == "dualpipev" else 2
    parallel = mp.ParallelConfig(
        pp=2, cp=cp, dp=dp, pp_schedule=schedule, pp_microbatches=microbatches,
        data_parallel=data_parallel or ("ddp" if cp > 1 else "none"),
    )  # fmt: skip
    module = mp.pipeline_module(model.double(), parallel, state, deepseek_plan(cfg)).train()
    cp_group, dp_cp_group = state.group("cp"), state.group("dp_cp")
    runner = BatchRunner(module, module, torch.device("cpu"), cp_group, cp, state.rank("cp"), None)
    step = PipelineStep(
        runner, parallel, state, microbatches, 2, SEQ, cfg.dim, VOCAB, True,
        model.sequence_inputs,
    )  # fmt: skip
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, module)]
    factors = [1.0, 0.5] * (microbatches // 2)
    mine = range(state.rank("dp") * microbatches, (state.rank("dp") + 1) * microbatches)
    first: dict[str, object] = {}
    for k in range(steps):
        count = dp * microbatches
        batches = [Batch(*packed_batch(seed + 1 + count * k + m)) for m in range(count)]
        total, extras = torch.zeros((), dtype=torch.float64), {}
        for m, batch in enumerate(batches):
            factor = factors[m % microbatches]
            out = reference(batch.inputs, None, batch.document_ids)
            loss, logged = reference.loss(out, batch.targets)
            (loss * factor / count).backward()
            if m not in mine:
                continue
            total += loss.detach() * factor
            for name, value in logged.items():  # in fp32, as the pp=1 step sums them
                extras[name] = extras.get(name, 0) + value.detach().float()
        result = step.run([batches[m] for m in mine], factors)
        if k == 0:
            expected = dict(reference.named_parameters())
            got = dict(result.extras, loss=result.total)
            if cp > 1:  # the MTP losses are already the whole sequence's on every rank
                got = {n: v for n, v in got.items() if n.startswith("mtp_") or n in CP_MEANS}
                for name in CP_MEANS:
                    got[name] = mt_comm.all_reduce(got[name].clone(), op="avg", group=cp_group)
            first = {
                "loss": rel_err(got.pop("loss"), total),
                "extras": {n: rel_err(v, extras[n], 1e-12) for n, v in got.items()},
                "reference_extras": sorted(extras),
                "grads": {
                    n: rel_err(whole_tensor(p.grad, dp_cp_group), expected[n].grad)
                    for n, p in module.named_parameters()
                },
            }
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    local = live_state(module, optimizers[1], torch.device("cpu"))
    layout = StateLayout.of(module, optimizers[1])
    written = shard_tensors(local, layout, TPLayout({}, 0, 1), state.rank("pp"), 0)
    # Under the V schedules the first and last chunks, and the one embedding, share rank 0.
    embedding = None
    if hasattr(module, "embed"):
        embedding = whole_tensor(module.embed.weight.detach(), dp_cp_group).contiguous()
    peer = embedding
    if module.shared_peer is not None:
        peer = module._exchange(embedding)
    return {
        **first,
        "written_embedding": sorted(n for n in written if "embed." in n),
        "copies_equal": embedding is None or bool(torch.equal(embedding, peer)),
        "embedding": 0.0 if embedding is None else rel_err(embedding, reference.embed.weight),
        "holds_mtp": any(n.startswith("mtp.") for n, _ in module.named_parameters()),
    }
