"""Worker function for the VLM under sequence and context parallelism (spawned gloo ranks).

:func:`vlm_parallel_step` builds ``vlm_tiny``'s shapes in float64 twice from one seed: a
one-process reference fed the whole micro-batch, and the model under ``mt_parallel.parallelize``
fed what the trainer feeds a rank (under CP its load-balanced chunks and their global
positions, every image of the micro-batch). It returns each rank's worst errors against the
reference over two forward/backward steps with an SGD update between, so a test can bound
them.
"""

from __future__ import annotations

import dataclasses

import torch

import mt_comm
import mt_parallel as mp
from mt_train.loss_weights import micro_batch_weights
from mt_train.models import model_sizes
from mt_train.models.vlm import IGNORE_INDEX, VisionLanguageModel
from mt_train.models.vlm.parallelize import vlm_plan

# float64: a layout differs from one process only in summation order (TP's partial sums,
# the SP reduce-scatter, the cp ranks' loss sums and DDP's gradient average), each ~1e-16
# relative per operation over a few hundred terms; 1e-10 leaves that a wide margin while a
# misplaced image feature, a missing gradient sum or a wrong loss weight moves the loss or the
# gradients by order 1 (each was tried).
FP64_BOUND = 1e-10
VOCAB = 320
STEPS = 2
LR = 0.5
"""Plain SGD between the steps, large enough that step 2 runs on visibly different weights."""
SEQ = 32
"""Two rows of 32 tokens: at cp=2 four chunks of 8; SP shards of 16 at tp=2, of 8 at cp=2 × tp=2
(where row 1's image, local positions 6-9 of rank 1, straddles them too)."""
IMAGE_STARTS = ((3, 22), (14,))
"""Where each row's images begin (4 tokens each). At cp=2 rank 0 holds chunks 0 and 3
(positions 0-7, 24-31), rank 1 chunks 1 and 2: row 0's second image straddles ranks 1 and 0,
and row 0's caption (positions 26-31) lies on rank 0 alone, so the ranks' unmasked target
counts differ. At tp=2 with SP (shards 0-15, 16-31) row 1's image straddles the shards."""


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-30) -> float:
    """``max|a − b| / max(max|b|, floor)`` in float64."""
    expected = expected.detach().double()
    scale = expected.abs().max().clamp_min(floor)
    return float((actual.detach().double() - expected).abs().max() / scale)


def vlm_batch(
    seed: int, image_starts: tuple[tuple[int, ...], ...] = IMAGE_STARTS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens with image placeholders, targets masked on images and prompts, the images."""
    cfg = model_sizes()["vlm_tiny"]
    per_image, v = cfg.image_tokens, cfg.vision
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (len(image_starts), SEQ), generator=g)
    targets = torch.randint(0, 256, tokens.shape, generator=g)
    for row, starts in enumerate(image_starts):
        for start in starts:
            tokens[row, start : start + per_image] = cfg.image_token_id
            targets[row, : start + per_image] = IGNORE_INDEX  # the prompt and the image
    n_images = sum(len(s) for s in image_starts)
    images = torch.rand(n_images, v.channels, v.image_size, v.image_size, generator=g)
    return tokens, targets, images.double()


PACKED_DOCUMENT_STARTS = ((0, 12, 29), (0, 10))
"""With ``packed``: where each row's samples begin (document ids ``0, 1, ...``). Row 0's images
fall in its samples 0 and 1, row 1's in its sample 1; at cp=2 the boundaries at 10 and 12
lie inside chunk 1 (rank 1) and 29 inside chunk 3 (rank 0), at tp=2 with SP 12 and 10 inside
shard 0 and 29 inside shard 1, so the masks and the restarted positions cross every cut."""


def packed_documents(rows: int) -> torch.Tensor:
    """Document ids ``(rows, SEQ)`` with samples starting at :data:`PACKED_DOCUMENT_STARTS`."""
    docs = torch.zeros(rows, SEQ, dtype=torch.long)
    for row, starts in enumerate(PACKED_DOCUMENT_STARTS[:rows]):
        for start in starts[1:]:
            docs[row, start:] += 1
    return docs


def vlm_parallel_step(
    tp: int,
    cp: int,
    sp: bool,
    seed: int = 0,
    steps: int = STEPS,
    packed: bool = False,
    reduction: str = "none",
    cp_attention: str = "all_gather",
) -> dict[str, object]:
    """The worst error of the loss, logits and every gradient over ``steps`` SGD steps (each
    on a new micro-batch) against the one-process reference; ``packed``: rows of several
    samples (document ids and the RoPE positions restarting per sample, which each rank
    receives cut like the tokens, as the trainer passes them); ``reduction``: the projector's
    token reduction at r=2 on a 4×4 grid of 2-pixel patches (4 tokens per image, as without);
    ``cp_attention``: the decoder's attention over cp (K/V all-gathered or passed around the
    ring)."""
    state = mt_comm.init_parallel_state(cp=cp, tp=tp)
    cfg = dataclasses.replace(model_sizes()["vlm_tiny"], vocab_size=VOCAB, dropout=0.0)
    if reduction != "none":
        vision = dataclasses.replace(cfg.vision, patch_size=2)
        cfg = dataclasses.replace(cfg, vision=vision, projector_reduction=reduction)
    reference = VisionLanguageModel(cfg)
    mp.init_weights(reference, seed)
    reference = reference.double()
    model = VisionLanguageModel(cfg)
    mp.init_weights(model, seed)
    config = mp.ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp, cp_attention=cp_attention)
    model = mp.parallelize(model.double(), config, state, vlm_plan(cfg))
    inner = model.module if hasattr(model, "module") else model  # DDP over cp
    cp_group, tp_rank = state.group("cp"), state.rank("tp")
    positions = mp.load_balanced_positions(SEQ, cp, state.rank("cp"))
    plan = mp.tp_shard_plan(reference)
    loss_errors, logits_errors, counts = [], [], []
    grads: dict[str, float] = {}
    for step in range(steps):
        tokens, targets, images = vlm_batch(seed + 1 + step)
        docs = packed_documents(tokens.shape[0]) if packed else None
        row_inputs = reference.sequence_inputs(tokens, targets, docs)
        ref_logits = reference(tokens, None, docs, images=images, **row_inputs)
        ref_loss, ref_extras = reference.loss(ref_logits, targets)
        ref_loss.backward()

        local_tokens, local_targets = (mp.shard_sequence(x, 1, cp_group) for x in (tokens, targets))
        local_docs = None if docs is None else mp.shard_sequence(docs, 1, cp_group)
        local_inputs = {k: mp.shard_sequence(v, 1, cp_group) for k, v in row_inputs.items()}
        logits = model(
            local_tokens, positions if cp > 1 else None, local_docs, images=images, **local_inputs
        )
        loss, extras = inner.loss(logits, local_targets)
        loss.backward()  # DDP averages the gradients over cp

        mean_loss = loss.detach().clone()
        mt_comm.all_reduce(mean_loss, op="avg", group=cp_group)
        full = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
        expected = mp.shard_state_dict(full, plan, tp_rank, tp)
        # The attention key biases' gradient is zero in exact arithmetic (softmax is invariant
        # to a shift of every score by q·b_k), so theirs is rounding noise: errors are relative
        # to at least 1e-6 of the largest gradient.
        floor = 1e-6 * max(float(g.abs().max()) for g in full.values())
        for name, p in inner.named_parameters():
            if p.requires_grad and name in expected:
                error = rel_err(p.grad, expected[name], floor)
                grads[name] = max(grads.get(name, 0.0), error)
        ref_logits_local = ref_logits[:, positions].chunk(tp, dim=-1)[tp_rank]
        loss_errors.append(rel_err(mean_loss, ref_loss))
        logits_errors.append(rel_err(logits, ref_logits_local))
        counts.append((float(extras["loss_tokens"]), float(ref_extras["loss_tokens"])))
        with torch.no_grad():
            for module in (reference, inner):
                for param in module.parameters():
                    if param.grad is not None:
                        param -= LR * param.grad
                        param.grad = None
    return {
        "loss": max(loss_errors),
        "logits": max(logits_errors),
        "grads": grads,
        "graded": sorted(name for name, p in reference.named_parameters() if p.requires_grad),
        "counts": counts,
    }


PIPELINE_IMAGE_STARTS = (IMAGE_STARTS, ((), ()), ((0,), (27,)), ((8, 12), ()))
"""Four micro-batches of two rows: three images (at tp=2 with SP row 1's straddles the shards),
none (the first chunk gets no ``images`` input), one at each end of the rows, two adjacent in
one row. Their image counts and unmasked target counts all differ, so an image placed in
another micro-batch's forward, or a loss weighted by the wrong count, changes the result."""


def vlm_pipeline_step(
    schedule: str,
    chunks: int = 1,
    layers: int = 2,
    tp: int = 1,
    sp: bool = False,
    cp: int = 1,
    fp8: bool = False,
    seed: int = 0,
) -> dict[str, object]:
    """One pipelined step of ``vlm_tiny``'s shapes in float64 at ``pp = world / (tp·cp)``
    against one process running the whole batch (all micro-batches' rows) at once: the step's
    loss, the masked mean over the whole batch (on the ranks holding the head; under CP the
    mean over the cp ranks, which the trainer reports), with the trainer's micro-batch weights
    (:mod:`mt_train.loss_weights`), each micro-batch's own masked mean, and every gradient
    this rank holds (under CP averaged over the cp ranks, as the trainer's data-parallel
    reduction does). With ``fp8`` both run every linear but the head in tensorwise FP8, in
    fp32."""
    import torch.distributed as dist

    import mt_fp8

    pp = dist.get_world_size() // (tp * cp)
    microbatches = len(PIPELINE_IMAGE_STARTS)
    state = mt_comm.init_parallel_state(tp=tp, cp=cp, pp=pp)
    config = mp.ParallelConfig(
        tp=tp, cp=cp, pp=pp, sequence_parallel=sp, data_parallel="none", pp_schedule=schedule,
        pp_chunks=chunks, pp_microbatches=microbatches,
    )  # fmt: skip
    cfg = dataclasses.replace(
        model_sizes()["vlm_tiny"], vocab_size=VOCAB, dropout=0.0, n_layers=layers, fp8_vision=fp8
    )
    dtype = torch.float32 if fp8 else torch.float64
    options = mp.FP8Options(mt_fp8.TensorwiseScaling()) if fp8 else None
    reference = VisionLanguageModel(cfg)
    mp.init_weights(reference, seed)
    reference = reference.to(dtype)
    if options is not None:
        mp.apply_fp8_options(reference, vlm_plan(cfg), options, None)
    model = VisionLanguageModel(cfg)
    mp.init_weights(model, seed)
    chunk_modules = mp.pipeline_chunks(model.to(dtype), config, state, vlm_plan(cfg), options)

    batches = [
        (tokens, targets, images.to(dtype))
        for m, starts in enumerate(PIPELINE_IMAGE_STARTS)
        for tokens, targets, images in [vlm_batch(seed + 1 + m, starts)]
    ]
    counts = torch.cat([(b[1] != IGNORE_INDEX).sum(1) for b in batches]).numpy()
    factors = micro_batch_weights(counts, len(batches[0][0]), 1, 0)
    assert factors is not None
    whole = [torch.cat([b[i] for b in batches]) for i in range(3)]
    ref_loss, _ = reference.loss(reference(whole[0], images=whole[2]), whole[1])
    if not fp8:
        ref_loss.backward()
    ref_losses = []
    for m, (tokens, targets, images) in enumerate(batches):
        loss, _ = reference.loss(reference(tokens, images=images if len(images) else None), targets)
        if fp8:
            # Tensorwise scales are per tensor, so a whole-batch forward quantizes with other
            # scales than the pipeline's micro-batches: the FP8 reference accumulates the same
            # micro-batches with the same weights (equal to the whole-batch loss in exact
            # arithmetic, as the float64 runs check).
            (loss * factors[m] / microbatches).backward()
        ref_losses.append(loss.detach())
    if fp8:
        ref_loss = sum(loss * f for loss, f in zip(ref_losses, factors, strict=True)) / microbatches

    rows, local = len(PIPELINE_IMAGE_STARTS[0]), SEQ // cp
    shapes = mp.StageShapes(
        tokens=((rows, local), torch.long),
        hidden=((rows, local // tp if sp else local, cfg.dim), dtype),
        logits=((rows, local, VOCAB // tp), dtype),
    )
    runner = mp.PipelineSchedule(
        chunk_modules, schedule, pp, state.rank("pp"), microbatches, chunks, shapes,
        torch.device("cpu"), state.group("pp"), model.loss,
    )  # fmt: skip
    cp_group = state.group("cp")
    positions = mp.load_balanced_positions(SEQ, cp, state.rank("cp")) if cp > 1 else None
    kwargs = [
        {"positions": positions, **({"images": images} if len(images) else {})}
        for _, _, images in batches
    ]
    tokens, targets = (
        [mp.shard_sequence(b[i], 1, cp_group) if cp > 1 else b[i] for b in batches] for i in (0, 1)
    )
    result = runner.step(tokens, targets, kwargs, factors)
    losses = [mt_comm.all_reduce(loss.clone(), op="avg", group=cp_group) for loss in result.losses]
    total = [rel_err(sum(losses) / microbatches, ref_loss)] if losses else []
    for param in (p for c in chunk_modules for p in c.parameters() if p.grad is not None):
        mt_comm.all_reduce(param.grad, op="avg", group=cp_group)  # float64, not a flat fp32

    full = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    expected = mp.shard_state_dict(full, mp.tp_shard_plan(reference), state.rank("tp"), tp)
    # As in vlm_parallel_step: the key biases' gradient is rounding noise around zero.
    floor = 1e-6 * max(float(g.abs().max()) for g in full.values())
    grads = {
        name: rel_err(p.grad, expected[name], floor)
        for chunk in chunk_modules
        for name, p in chunk.named_parameters()
        if p.requires_grad
    }
    return {
        "grads": grads,
        "losses": [rel_err(loss / factors[m], ref_losses[m]) for m, loss in enumerate(losses)],
        "total": total,
        "factors": factors,
        "holds_last": any(c.last for c in chunk_modules),
        "graded": sorted(name for name, p in reference.named_parameters() if p.requires_grad),
        "sinks": len(runner.sinks),
        "fp8_layers": sorted(
            name
            for chunk in chunk_modules
            for name, m in chunk.named_modules()
            if getattr(m, "fp8_enabled", False)
        ),
    }


def fp8_tensorwise_model(cfg) -> torch.nn.Module:
    """``cfg``'s model built on the CPU (seed 1) and parallelized alone with tensorwise FP8."""
    from mt_train.config.schema import FP8Config
    from mt_train.models import build_model, parallelize

    mt_comm.init_distributed(device="cpu")
    state = mt_comm.init_parallel_state(dp=1)
    try:
        model = build_model(cfg, "cpu", seed=1)
        parallelize(model, cfg, mp.ParallelConfig(), state, FP8Config(recipe="tensorwise"))
    finally:
        mt_comm.destroy_parallel_state()
    return model
