"""What document masking costs a training step: no mask, the explicit mask, FlexAttention.

Run on an H200: ``python benchmarks/doc_masking.py --out doc_masking.jsonl`` (a few minutes);
``--smoke`` runs tiny shapes on whatever device is present (CPU: fp32, eager; torch's
FlexAttention has no CPU backward, so there the flex rows need its refusal lifted, as the smoke
test does).

Model rows (``kind: step``): one training step (forward, backward, fused AdamW update) of
mt-train's Llama at the Llama-3-8B shapes cut to ``--layers`` layers (default 4), batch 1,
sequence 8192, bf16 autocast, fp32 master weights, over packed documents whose lengths are
drawn uniformly from ``[doc_len/2, 3·doc_len/2]`` (``--doc-len``, default 1024; fixed seed).
Stacks (``mt_parallel.document_attention``):

* ``unmasked``: plain causal attention over the packed window (SDPA's flash kernel), the cost
  of training without ``data.document_masking``;
* ``explicit``: ``data.document_masking_kernel=explicit``, a boolean ``(1, 1, S, S)`` mask
  handed to SDPA;
* ``flex``: ``data.document_masking_kernel=flex``, ``torch.compile``'d ``flex_attention``
  with a block mask built from the document ids once per step (its build time is included:
  every step gets a new id tensor, as every micro-batch does in training).

Each stack runs in ``--modes`` ``eager`` (blocks as written) and/or ``compiled`` (every block
under ``torch.compile``, ``parallel.compile=true``) on a fresh model from the same seed;
``overhead`` is the step time over the unmasked step of the same mode, minus one. The first
step's loss (same weights and tokens in every stack) shows the masked stacks compute the same
thing (``explicit`` and ``flex`` agree to bf16 rounding; ``unmasked`` differs).

Attention rows (``kind: attention``): the attention core alone at the model's head shapes
(32 query heads, 8 KV heads, head dim 128), forward + backward, bf16, the same three stacks,
and ``mask_ms``: building the block mask (flex) or the boolean mask (explicit) on its own.
"""

from __future__ import annotations

import argparse
from typing import Any

import harness
import torch

import mt_comm
import mt_fp8
import mt_parallel
from mt_parallel.context_parallel import _mask
from mt_parallel.document_attention import document_block_mask

STACKS = ("unmasked", "explicit", "flex")
MODES = ("eager", "compiled")
SEQ, SMOKE_SEQ = 8192, 64


def document_ids(seq: int, doc_len: int, device: str, seed: int = 0) -> torch.Tensor:
    """``(1, seq)`` ids of packed documents, lengths uniform in ``[doc_len/2, 3·doc_len/2]``."""
    generator = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq:
        length = int(torch.randint(doc_len // 2, 3 * doc_len // 2 + 1, (), generator=generator))
        lengths.append(min(length, seq - total))
        total += lengths[-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.view(1, seq).to(device)


def model_config(smoke: bool, layers: int) -> Any:
    from mt_train import compose_config, to_train_config

    if smoke:
        return to_train_config(
            compose_config(["model.vocab_size=320", f"model.n_layers={layers}"])
        ).model
    return to_train_config(compose_config(["model=llama3_8b", f"model.n_layers={layers}"])).model


def bench_steps(cfg: Any, seq: int, doc_len: int, device: str, args: Any) -> list[dict]:
    from mt_train.config.schema import FP8Config
    from mt_train.models import build_model
    from mt_train.models.build import parallelize

    ids = document_ids(seq, doc_len, device)
    tokens = torch.randint(
        0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(2)
    )
    tokens = tokens.to(device)
    rows = []
    state = mt_comm.init_parallel_state()
    try:
        for mode in args.modes:
            for stack in STACKS:
                torch._dynamo.reset()
                model = build_model(cfg, device, seed=0)
                model = parallelize(
                    model, cfg, mt_parallel.ParallelConfig(), state,
                    FP8Config(recipe=args.recipe), compile_blocks=mode == "compiled",
                )  # fmt: skip
                if stack != "unmasked":
                    mt_parallel.apply_document_mask_kernel(model, stack)
                docs = None if stack == "unmasked" else ids
                if device == "cuda":
                    optimizer: torch.optim.Optimizer = mt_fp8.FusedAdamW(model.parameters())
                else:
                    optimizer = torch.optim.AdamW(model.parameters())
                losses: list[float] = []

                def step(
                    model: Any = model, opt: Any = optimizer, docs: Any = docs, losses: Any = losses
                ) -> None:
                    # A new id tensor every step, as every micro-batch brings: flex builds its
                    # block mask again (once per step), the explicit path its mask per layer.
                    step_docs = None if docs is None else docs.clone()
                    with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
                        logits = model(tokens[:, :-1], None, step_docs)
                    loss = model.loss(logits, tokens[:, 1:])
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if not losses:
                        losses.append(float(loss.detach()))

                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                ms = harness.median_ms(step, repeats=args.iters, warmup=args.warmup, device=device)
                rows.append({
                    "kind": "step", "mode": mode, "stack": stack, "layers": cfg.n_layers,
                    "tokens": seq, "doc_len": doc_len, "documents": int(ids.max()) + 1,
                    "ms": ms, "tokens_per_s": seq / ms * 1e3, "first_loss": losses[0],
                    "peak_gib": _peak(device),
                })  # fmt: skip
                del model, optimizer, step
                if device == "cuda":
                    torch.cuda.empty_cache()
    finally:
        mt_comm.destroy_parallel_state()
    for row in rows:
        base = next(r for r in rows if r["mode"] == row["mode"] and r["stack"] == "unmasked")
        row["overhead"] = row["ms"] / base["ms"] - 1
    return rows


def bench_attention(cfg: Any, seq: int, doc_len: int, device: str, args: Any) -> list[dict]:
    ids = document_ids(seq, doc_len, device)
    generator = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    heads, kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    shapes = ((1, heads, seq, head_dim), (1, kv_heads, seq, head_dim), (1, kv_heads, seq, head_dim))
    qkv = [torch.randn(s, generator=generator).to(device, dtype).requires_grad_() for s in shapes]
    dy = torch.randn(1, heads, seq, head_dim, generator=generator).to(device, dtype)
    positions = torch.arange(seq, device=device)
    mask_builders = {
        "unmasked": None,
        "explicit": lambda: _mask(positions, seq, ids, ids),
        "flex": lambda: document_block_mask(ids),
    }
    rows = []
    for stack in STACKS:
        core = mt_parallel.CoreAttention()
        if stack != "unmasked":
            core.set_document_mask_kernel(stack)
        docs = None if stack == "unmasked" else ids

        def call(core: Any = core, docs: Any = docs) -> None:
            for t in qkv:
                t.grad = None
            core(*qkv, None if docs is None else docs.clone()).backward(dy)

        ms = harness.median_ms(call, repeats=args.iters, warmup=args.warmup, device=device)
        builder = mask_builders[stack]
        mask_ms = (
            None
            if builder is None
            else harness.median_ms(builder, repeats=args.iters, warmup=1, device=device)
        )
        rows.append({
            "kind": "attention", "stack": stack, "tokens": seq, "doc_len": doc_len,
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "ms": ms,
            "mask_ms": mask_ms,
        })  # fmt: skip
    for row in rows:
        row["overhead"] = row["ms"] / rows[0]["ms"] - 1
    return rows


def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def print_table(rows: list[dict]) -> None:
    print(
        f"{'kind':<10}{'mode':<10}{'stack':<10}{'ms':>10}{'tokens/s':>10}{'overhead':>10}"
        f"{'mask ms':>9}{'first loss':>12}"
    )
    for row in rows:
        tokens_per_s = f"{row['tokens_per_s']:.0f}" if "tokens_per_s" in row else "-"
        mask_ms = "-" if row.get("mask_ms") is None else f"{row['mask_ms']:.2f}"
        loss = f"{row['first_loss']:.5f}" if "first_loss" in row else "-"
        print(
            f"{row['kind']:<10}{row.get('mode', '-'):<10}{row['stack']:<10}{row['ms']:>10.2f}"
            f"{tokens_per_s:>10}{row['overhead']:>+10.1%}{mask_ms:>9}{loss:>12}"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device")
    parser.add_argument("--layers", type=int, default=4, help="Llama-3-8B layers kept")
    parser.add_argument("--seq", type=int, default=None, help=f"tokens per step ({SEQ})")
    parser.add_argument("--doc-len", type=int, default=1024, help="mean document length")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--recipe", default="none", help="mt-fp8 recipe of the linears")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip-steps", action="store_true", help="attention rows only")
    parser.add_argument("--out", default=None, help="append result rows (JSON lines) here")
    args = parser.parse_args(argv)
    if args.smoke:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        seq = args.seq or SMOKE_SEQ
    else:
        harness.require_cuda()
        device, seq = "cuda", args.seq or SEQ
    cfg = model_config(args.smoke, args.layers)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(
        f"device: {name}, torch {torch.__version__}, {cfg.name} x{cfg.n_layers} layers, seq {seq}"
    )
    common = {"device": name, "torch": torch.__version__, "recipe": args.recipe}
    # Each phase's rows are written as soon as it ends, so a run cut short keeps the attention rows.
    rows = [{**row, **common} for row in bench_attention(cfg, seq, args.doc_len, device, args)]
    for row in rows:
        harness.emit(row, args.out)
    if not args.skip_steps:
        steps = [{**row, **common} for row in bench_steps(cfg, seq, args.doc_len, device, args)]
        for row in steps:
            harness.emit(row, args.out)
        rows += steps
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
