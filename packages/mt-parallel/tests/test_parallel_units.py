"""Single-process tests: config validation, state-dict sharding, recompute, CE, CP layout."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from parallel_tolerances import FP64_VS_FP64
from torch.utils._python_dispatch import TorchDispatchMode
from toy_lm import PLAN, DecoderLM

import mt_parallel as mp


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sequence_parallel": True}, "sequence_parallel=True needs tensor parallelism"),
        ({"tp": 0}, r"parallel.tp=0 must be a positive integer"),
        ({"data_parallel": "zero3"}, r"data_parallel='zero3'; valid: ddp, fsdp, zero1, none"),
        ({"recompute": "some"}, r"recompute='some'; valid: none, selective, full"),
        (
            {"recompute": "selective", "recompute_targets": ["norm"]},
            r"recompute_targets=\['norm'\]",
        ),
        ({"pp": 2, "pp_schedule": "pipedream"}, r"pp_schedule='pipedream'; valid: gpipe, 1f1b"),
        ({"pp": 4, "pp_microbatches": 3}, r"1f1b at pp=4 needs at least 4 micro-batches.*got 3"),
        ({"pp": 2, "pp_chunks": 2}, r"parallel.1f1b holds exactly 1 chunk\(s\) per rank"),
        ({"pp": 2, "pp_layers": [1, 2, 3]}, r"needs pp·chunks = 2·1 = 2 entries"),
        ({"pp_chunks": 2}, r"need pipeline parallelism \(pp > 1\)"),
        ({"pp": 2, "pp_schedule": "zbv", "compile": True}, "refuses compiled stages"),
        (
            {"recompute": "full", "recompute_keep": ["mlp"]},
            r"recompute_keep=\['mlp'\]; valid entries: attention",
        ),
        ({"recompute_keep": ["attention"]}, r"needs parallel.recompute=full \(got 'none'\)"),
        ({"cp_attention": "ulysses"}, r"cp_attention='ulysses'; valid: all_gather, ring"),
    ],
)
def test_config_rejects_bad_values_with_their_names(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mp.ParallelConfig(**kwargs)


def test_config_checks_the_model_and_the_world() -> None:
    config = mp.ParallelConfig(tp=4, cp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="tp=4 does not divide num_heads=6"):
        config.validate_model(num_heads=6, num_kv_heads=2, vocab_size=64)
    with pytest.raises(ValueError, match="tp=4 does not divide num_kv_heads=2"):
        config.validate_model(num_heads=8, num_kv_heads=2, vocab_size=64)
    with pytest.raises(ValueError, match="tp=4 does not divide vocab_size=50"):
        config.validate_model(num_heads=8, num_kv_heads=4, vocab_size=50)
    with pytest.raises(ValueError, match=r"sequence length 18 to be divisible by 2·cp = 4"):
        config.validate_model(num_heads=8, num_kv_heads=4, vocab_size=64, seq_len=18)
    with pytest.raises(ValueError, match=r"per-rank sequence length 10 \(= 20 / cp=2\)"):
        config.validate_model(num_heads=8, num_kv_heads=4, vocab_size=64, seq_len=20)
    config.validate_model(num_heads=8, num_kv_heads=4, vocab_size=64, seq_len=32)
    assert config.validate_world(16) == 2
    with pytest.raises(ValueError, match="world size 12 is not divisible by tp·cp·pp = 4·2·1"):
        config.validate_world(12)
    with pytest.raises(ValueError, match=r"dp·cp·tp·pp = 3·2·4·1 = 24 must equal the world"):
        mp.ParallelConfig(tp=4, cp=2, dp=3).validate_world(16)


def test_ring_attention_without_attention_dropout_or_cp_is_refused() -> None:
    with pytest.raises(ValueError, match="ring attention has no attention dropout"):
        mp.apply_context_parallel(DecoderLM(16, 16, 1, 2, 1, 16, dropout=0.1), None, ring=True)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="needs a cp group of more than one rank"):
        mp.ring_attention(q, q, q, None)
    with pytest.raises(ValueError, match=r"document ids of shape \(1, 3\) do not match"):
        mp.context_parallel_attention(q, q, q, None, document_ids_Bt=torch.zeros(1, 3))


def test_sequence_parallel_without_tp_is_refused_by_layers_and_transform() -> None:
    with pytest.raises(ValueError, match="sequence_parallel=True needs a tensor-parallel group"):
        mp.ColumnParallelLinear(8, 8, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence parallel needs tensor parallelism"):
        mp.apply_tensor_parallel(DecoderLM(16, 16, 1, 2, 1, 16), None, sequence_parallel=True)


def _tiny_lm(dropout: float = 0.0) -> DecoderLM:
    model = DecoderLM(64, 32, 3, 4, 2, 64, dropout=dropout)
    mp.init_weights(model, 0)
    return model


def test_shard_and_merge_state_dicts_round_trip() -> None:
    model = _tiny_lm()
    full = model.state_dict()
    plan = mp.tp_shard_plan(model)
    assert plan["layers.0.attention.o_proj.weight"] == 1
    assert plan["layers.0.mlp.gate_proj.weight"] == 0
    assert "layers.0.attention_norm.weight" not in plan
    for tp in (2, 4):
        pieces = [mp.shard_state_dict(full, plan, rank, tp) for rank in range(tp)]
        assert pieces[1]["embed.weight"].shape == (64 // tp, 32)
        assert pieces[1]["layers.0.attention.o_proj.weight"].shape == (32, 32 // tp)
        merged = mp.merge_state_dicts(pieces, plan)
        assert all(torch.equal(merged[key], full[key]) for key in full)
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        mp.shard_state_dict(full, plan, 0, 3)


def test_init_is_seeded_per_layer_name() -> None:
    a, b = _tiny_lm(), _tiny_lm()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    first, second = a.layers[0].mlp.up_proj.weight, a.layers[1].mlp.up_proj.weight
    assert not torch.equal(first, second)
    torch.manual_seed(123)  # the global RNG does not matter
    c = _tiny_lm()
    assert torch.equal(c.lm_head.weight, a.lm_head.weight)


@pytest.mark.parametrize(
    ("policy", "every", "targets", "recomputed"),
    [
        ("full", 1, ["attention"], 3),
        ("full", 2, ["attention"], 2),
        ("selective", 1, ["attention"], 3),
        ("selective", 1, ["attention", "mlp"], 6),
    ],
)
def test_recompute_changes_no_gradient_bit(
    policy: str, every: int, targets: list[str], recomputed: int
) -> None:
    base = _tiny_lm(dropout=0.2)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    grads = []
    for apply in (False, True):
        model = copy.deepcopy(base)
        if apply:
            mp.apply_recompute(model, policy, every, targets, PLAN.block_types)
            assert sum(mp.is_recomputed(m) for m in model.modules()) == recomputed
        torch.manual_seed(7)  # dropout masks: drawn again on recompute, must be the same
        model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators that run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("device", "fp8"),
    [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=pytest.mark.gpu)],
)
def test_recompute_keeping_attention_runs_its_forward_once_with_the_same_gradients(
    device: str, fp8: bool
) -> None:
    # Full recompute runs the attention forward twice per block (forward, then the
    # recomputation); keeping its output runs it once, and the backward sees the same values,
    # so every gradient keeps its bits (with FP8 too: the recomputation re-quantizes the same
    # inputs with the same scales; on CUDA with mt_fp8's Triton kernels).
    base = DecoderLM(64, 128, 2, 4, 2, 256)
    mp.init_weights(base, 0)
    if fp8:
        from mt_fp8 import recipe_from_name

        mp.apply_fp8(base, recipe_from_name("tensorwise"), skip=("lm_head",))
    base.to(device)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    grads, attention_forwards = {}, {}
    for keep in (None, (), ("attention",)):
        model = copy.deepcopy(base)
        if keep is not None:
            mp.apply_recompute(model, "full", block_types=PLAN.block_types, keep=keep)
        counter = _OpCounter()
        # bf16 on CUDA, as the trainer runs: fp32 attention there takes PyTorch's math path,
        # which has no fused operator to keep.
        autocast = torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda")
        with counter, autocast:
            model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads[keep] = [p.grad for p in model.parameters()]
        attention_forwards[keep] = sum(
            n
            for name, n in counter.counts.items()
            if "_scaled_dot_product" in name and "backward" not in name
        )
    assert attention_forwards == {None: 2, (): 4, ("attention",): 2}
    for keep in ((), ("attention",)):
        assert all(torch.equal(a, b) for a, b in zip(grads[None], grads[keep], strict=True))


def test_recompute_keep_modes_are_per_thread() -> None:
    # DualPipeV's overlapped halves run a forward and a backward on two threads that take
    # turns inside checkpoints: a kept module enters only a mode its own thread published.
    import threading

    from mt_parallel import recompute

    seen: list[list[object]] = []
    with recompute._publish("this thread's mode"):
        other = threading.Thread(target=lambda: seen.append(list(recompute._active_keep_modes())))
        other.start()
        other.join()
        assert recompute._active_keep_modes() == ["this thread's mode"]
    assert seen == [[]] and recompute._active_keep_modes() == []


@pytest.mark.parametrize(
    "backend",
    # Dynamo and AOTAutograd trace the checkpoint (where the refusal was); Inductor's code
    # generation adds ~75 s of first compilation on two CPU cores, so it runs in the full tier.
    ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("keep", [(), ("attention",)])
def test_compiled_recomputed_blocks_match_eager_blocks(keep: tuple[str, ...], backend: str) -> None:
    # parallel.compile compiles each block after recompute wraps it: torch.compile must trace
    # the checkpoint (it refused an explicitly passed default context_fn, and accepts the
    # selective one). fp64, so that the compiled kernels' other summation order stays at
    # rounding level (FP64_VS_FP64, parallel_tolerances) against the eager, unwrapped model.
    base = DecoderLM(64, 32, 2, 4, 2, 64).double()
    mp.init_weights(base, 0)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    grads = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        if compiled:
            mp.apply_recompute(model, "full", block_types=PLAN.block_types, keep=keep)
            for block in model.layers:
                block.compile(backend=backend)
        model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append([p.grad for p in model.parameters()])
    for eager, compiled in zip(*grads, strict=True):
        assert (compiled - eager).abs().max() <= FP64_VS_FP64 * eager.abs().max()


def test_recompute_keep_is_refused_with_dropout_or_without_full_recompute() -> None:
    with pytest.raises(ValueError, match=r"keep=\['attention'\] with dropout in DecoderBlock"):
        mp.apply_recompute(
            _tiny_lm(dropout=0.1), "full", block_types=PLAN.block_types, keep=["attention"]
        )
    with pytest.raises(ValueError, match=r"needs the full policy, got 'selective'"):
        mp.apply_recompute(_tiny_lm(), "selective", keep=["attention"])
    with pytest.raises(ValueError, match=r"valid entries: attention"):
        mp.apply_recompute(_tiny_lm(), "full", block_types=PLAN.block_types, keep=["everything"])


def test_apply_fp8_ties_the_input_scales_of_layers_reading_one_input() -> None:
    """q/k/v and gate/up share one delayed INPUT scale after ``apply_fp8``; training with the
    tie gives the same bits as layers with scales of their own (equal inputs, equal amaxes)."""
    from mt_fp8 import DelayedScaling, update_fp8_scales

    recipe = DelayedScaling(amax_history_len=4)
    tied, untied = _tiny_lm(), _tiny_lm()
    mp.apply_fp8(tied, recipe, skip=("lm_head",))
    for name, module in untied.named_modules():
        if hasattr(module, "enable_fp8") and "lm_head" not in name:
            module.enable_fp8(recipe)
    attention, mlp = tied.layers[0].attention, tied.layers[0].mlp
    assert attention.k_proj.fp8_meta.input_meta is attention.q_proj.fp8_meta
    assert attention.v_proj.fp8_meta.input_meta is attention.q_proj.fp8_meta
    assert mlp.up_proj.fp8_meta.input_meta is mlp.gate_proj.fp8_meta
    assert attention.o_proj.fp8_meta.input_meta is attention.o_proj.fp8_meta
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 17), generator=generator)
        losses = []
        for model in (tied, untied):
            model.zero_grad()
            loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            losses.append(loss)
            with torch.no_grad():
                for param in model.parameters():
                    param -= 0.5 * param.grad
            update_fp8_scales(model, recipe)
        assert torch.equal(*losses)
    assert all(
        torch.equal(a, b) for a, b in zip(tied.parameters(), untied.parameters(), strict=True)
    )


def test_vocab_parallel_ce_equals_torch_on_one_rank() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=generator)
    targets[1, 2] = -100
    ours = mp.vocab_parallel_cross_entropy(logits, targets)
    (grad,) = torch.autograd.grad(ours, logits)
    theirs = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    (grad_ref,) = torch.autograd.grad(theirs, logits)
    assert abs(float(ours.detach() - theirs.detach())) < FP64_VS_FP64
    assert float((grad - grad_ref).abs().max()) < FP64_VS_FP64
    assert torch.autograd.gradcheck(
        lambda z: mp.vocab_parallel_cross_entropy(z, targets, reduction="sum"), (logits,)
    )


def test_load_balanced_layout() -> None:
    assert mp.load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert mp.load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert mp.load_balanced_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match=r"sequence length 10 to be divisible by 2·cp = 4"):
        mp.load_balanced_positions(10, 2, 0)


def test_attention_with_per_row_positions_equals_each_row_alone() -> None:
    """Per-row positions ``(B, S)`` rotate each row by its own table: every row of the batch
    equals that row run alone with its positions as the shared ``(S,)`` row (fp64: the same
    products, which a batched kernel may sum in another order, ulps of values of order 1)."""
    mp.manual_seed(0)
    attention = mp.Attention(32, 4, 2).double()
    mp.init_weights(attention, 0)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [5, 6, 7, 8, 9, 10]])
    out = attention(x, positions)
    for row in range(2):
        alone = attention(x[row : row + 1], positions[row])
        torch.testing.assert_close(out[row : row + 1], alone, rtol=0, atol=1e-12)
    assert not torch.equal(out[:1], attention(x[:1]))  # the positions change the output


def test_readme_quick_start_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import re
    from pathlib import Path

    import mt_comm

    readme = Path(__file__).resolve().parents[1] / "README.md"
    code = re.search(r"```python\n(.*?)```", readme.read_text(), re.S).group(1)
    try:
        exec(compile(code, str(readme), "exec"), {})
    finally:
        mt_comm.destroy_parallel_state()
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 3 and losses[2] < losses[0]


def test_distributed_optimizer_split_step_and_decay_filter_equal_adamw() -> None:
    """One rank, fp64: ``reduce_gradients`` + ``apply_update`` with ``decay=`` matrices only
    equal torch AdamW with decay on the matrix and none on the vector, step by step, and the
    norm equals torch's clipping norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4).double())
    reference = copy.deepcopy(model)
    weight, bias = reference[0].weight, reference[0].bias
    adamw = torch.optim.AdamW(
        [{"params": [weight], "weight_decay": 0.1}, {"params": [bias], "weight_decay": 0.0}],
        lr=0.05,
    )
    zero1 = mp.DistributedOptimizer(
        model.parameters(), decay=lambda p: p.dim() >= 2, lr=0.05, weight_decay=0.1
    )
    for _ in range(3):
        x = torch.randn(5, 6, dtype=torch.float64)
        for net in (model, reference):
            net(x).square().sum().backward()
        norm = zero1.reduce_gradients()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch.testing.assert_close(norm, expected, rtol=FP64_VS_FP64, atol=FP64_VS_FP64)
        zero1.apply_update(0.5)
        adamw.step()
        for net in (model, reference):
            net.zero_grad()
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=FP64_VS_FP64, atol=FP64_VS_FP64)
    with pytest.raises(RuntimeError, match=r"needs reduce_gradients\(\) first"):
        zero1.apply_update()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_row_parallel_swiglu_forward_matches_swiglu_then_forward(fp8: bool) -> None:
    """``forward_swiglu(g, u)`` (what the MLP calls; FP8 quantizes the product straight from g
    and u) gives the bits of ``forward(swiglu(g, u))``: output and the gradients of g, u and the
    weight."""
    from mt_fp8.ops import swiglu

    torch.manual_seed(0)
    layer = mp.RowParallelLinear(64, 32, bias=True)
    twin = copy.deepcopy(layer)
    if fp8:
        mp.apply_fp8(layer)
        mp.apply_fp8(twin)
    gate, up = (torch.randn(2, 8, 64, requires_grad=True) for _ in range(2))
    gate_copy, up_copy = (t.detach().clone().requires_grad_() for t in (gate, up))
    y = layer.forward_swiglu(gate, up)
    y_twin = twin(swiglu(gate_copy, up_copy))
    dy = torch.randn_like(y)
    y.backward(dy)
    y_twin.backward(dy)
    assert torch.equal(y, y_twin)
    assert torch.equal(gate.grad, gate_copy.grad) and torch.equal(up.grad, up_copy.grad)
    assert torch.equal(layer.weight.grad, twin.weight.grad)
    with pytest.raises(ValueError, match="forward_swiglu needs input_is_parallel=True"):
        mp.RowParallelLinear(64, 32, input_is_parallel=False).forward_swiglu(gate, up)


@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast", "bf16"])
@pytest.mark.parametrize("kind", ["column", "column_2d", "row", "row_swiglu", "row_sliced"])
def test_deferred_weight_gradients_equal_the_plain_linear_bit_for_bit(
    kind: str, precision: str
) -> None:
    """With a ``wgrad_sink`` the high-precision GEMM's backward gives ``dx`` and queues
    ``dW``/``db``; once the sink's work runs, every gradient (input, weight, the column-parallel
    GEMM's bias) equals the plain ``F.linear`` path's bit for bit, accumulated over two
    micro-batches, under fp32, bf16 autocast on fp32 parameters, and bf16 parameters; a
    non-contiguous output gradient and a sliced (non-contiguous) input included. Every tensor
    a queued closure reaches is among the ones its ``holds`` names (what a meter counts)."""
    from mt_fp8 import WeightGradSink
    from mt_fp8.testing import watch_unheld

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if kind.startswith("column"):
        plain = mp.ColumnParallelLinear(64, 32, bias=True, dtype=dtype)
    else:
        plain = mp.RowParallelLinear(64, 32, bias=True, dtype=dtype)
    layer = copy.deepcopy(plain)
    sink = layer.wgrad_sink = WeightGradSink()
    unheld = watch_unheld(sink, layer.parameters())
    shape = (8, 64) if kind == "column_2d" else (2, 8, 96 if kind == "row_sliced" else 64)
    inputs = [[torch.randn(shape, dtype=dtype) for _ in range(2)] for _ in range(2)]

    def run(module: torch.nn.Module, x: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16_autocast"):
            if kind == "row_swiglu":
                return module.forward_swiglu(x, up)
            return module(x[..., 16:80] if kind == "row_sliced" else x)

    grads = {}
    for name, module in (("plain", plain), ("deferred", layer)):
        leaves = [[t.clone().requires_grad_() for t in pair] for pair in inputs]
        for m, (x, up) in enumerate(leaves):
            y = run(module, x, up)
            dy = torch.randn(
                y.shape[::-1], dtype=y.dtype, generator=torch.Generator().manual_seed(m)
            )
            y.backward(dy.permute(*reversed(range(dy.dim()))))  # non-contiguous dy
        if module is layer:
            # The row-parallel bias is added after the reduction, outside the GEMM.
            assert layer.weight.grad is None
            assert (layer.bias.grad is None) == kind.startswith("column")
            assert len(sink) == 2  # one closure per micro-batch
            sink.take()()
        grads[name] = [module.weight.grad, module.bias.grad] + [t.grad for p in leaves for t in p]
    for ours, theirs in zip(grads["deferred"], grads["plain"], strict=True):
        assert (ours is None) == (theirs is None)
        assert ours is None or (ours.dtype == theirs.dtype and torch.equal(ours, theirs))
    assert len(sink) == 0 and unheld == [0, 0]
    # run with grad mode on, the queued GEMMs record no graph (autograd's gradients carry none)
    assert not any(p.grad.requires_grad for p in layer.parameters() if p.grad is not None)


class _FP8MLP(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.fc1 = mp.ColumnParallelLinear(32, 64, bias=bias)
        self.fc2 = mp.RowParallelLinear(64, 32, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def test_biased_fp8_linears_split_a_compiled_module_into_no_more_graphs() -> None:
    """FP8 linears run eagerly behind a graph break; their biases (and the row-parallel
    reduction) are inside that eager region, so a compiled module with biased FP8 linears has
    the graphs of the unbiased one: here one, the GELU between them. With the bias added after
    the break each biased linear had added a graph (forward and backward each a compiled call)."""
    from torch._dynamo.testing import CompileCounter

    graphs = {}
    for bias in (False, True):
        torch.manual_seed(0)
        mlp = _FP8MLP(bias)
        mp.apply_fp8(mlp)
        eager = copy.deepcopy(mlp)
        counter = CompileCounter()
        torch._dynamo.reset()
        compiled = torch.compile(mlp, backend=counter)
        x = torch.randn(2, 577, 32)
        for _ in range(2):  # the second call must reuse the graphs
            y = compiled(x)
            y.square().mean().backward()
        graphs[bias] = counter.frame_count
        # The "eager" backend runs the captured graphs as traced: the same ops as eager.
        y_eager = eager(x)
        y_eager.square().mean().backward()
        assert torch.equal(y, y_eager)
        for ours, theirs in zip(mlp.parameters(), eager.parameters(), strict=True):
            assert torch.equal(ours.grad, 2 * theirs.grad)
    torch._dynamo.reset()
    assert graphs == {False: 1, True: 1}


def test_fp8_layers_keep_the_state_dict_of_the_model_without_fp8() -> None:
    """The FP8 layer running a parallel linear's or the experts' GEMM shares their weight and
    ``fp8_meta``: the state dict holds each tensor once, under the names of the model without
    FP8 (plus the delayed-scaling state), and loads strictly both ways."""
    from mt_fp8 import DelayedScaling
    from mt_parallel.moe.experts import GroupedLinear

    plain, fp8 = _tiny_lm(), _tiny_lm()
    mp.apply_fp8(fp8, DelayedScaling(amax_history_len=4), skip=("lm_head",))
    experts = GroupedLinear(2, 16, 16, 0.02)
    experts.enable_fp8(DelayedScaling(amax_history_len=4))
    for model, bare in ((fp8, plain), (experts, GroupedLinear(2, 16, 16, 0.02))):
        state = model.state_dict()
        assert not [k for k in state if "_fp8." in k]
        assert [k for k in state if "fp8_meta" not in k] == list(bare.state_dict())
        bare.load_state_dict({k: v for k, v in state.items() if "fp8_meta" not in k})
        model.load_state_dict(state)  # strict: the FP8 layer's entries filled in
        for module in model.modules():
            if getattr(module, "_fp8", None) is not None:
                assert module._fp8.weight is module.weight
