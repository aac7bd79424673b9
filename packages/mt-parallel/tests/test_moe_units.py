"""MoE layers on one process: the layer against a token-by-token float64 reference, routing
(group-limited selection, weights), balancing losses by hand, the aux-loss-free bias update,
capacity accounting, grouped GEMM against the loop, and bad configurations."""

from __future__ import annotations

import re

import pytest
import torch
from moe_reference import poison_rows_past_the_groups, reference_moe
from torch.utils.checkpoint import checkpoint

from mt_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mt_parallel.moe import (
    MoE,
    MoEConfig,
    bias_update,
    collect_aux_losses,
    expert_capacity,
    group_limited_mask,
    grouped_mm,
    looped_mm,
    max_violation,
    permute_plan,
    sequence_aux_loss,
    switch_aux_loss,
    update_expert_biases,
)

# Both sides in float64 with the same weights and short chains of dot products (length <= 64):
# differences are a few ulps of 1.1e-16 relative to the largest entry; 1e-12 leaves a wide
# margin and is far below what a wrong expert, weight or token (errors of 1e-2..1) produces.
FP64_BOUND = 1e-12
DIM = 32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def make_layer(seed: int = 0, **overrides) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(**{"num_experts": 8, "top_k": 2, "expert_ffn_dim": 16, **overrides})
    layer = MoE(DIM, cfg).double()
    layer.router.weight.data.normal_(0, 0.5)  # spread scores, so ties cannot decide the routing
    return layer


CONFIGS = {
    "softmax-top2": {},
    "sigmoid-grouped-shared": {
        "score_function": "sigmoid", "n_group": 4, "topk_group": 2, "top_k": 3,
        "routed_scaling_factor": 2.5, "n_shared_experts": 2, "balancing": "aux_free",
    },
    "softmax-grouped-unnormalized": {"n_group": 2, "topk_group": 1, "normalize_weights": False},
}  # fmt: skip


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_layer_matches_token_by_token_reference(overrides: dict) -> None:
    layer = make_layer(**overrides)
    x = torch.randn(2, 7, DIM, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = layer(x)
    y_ref = reference_moe(layer, x_ref)
    assert rel(y, y_ref) < FP64_BOUND
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    assert rel(x.grad, x_ref.grad) < FP64_BOUND


def test_gradients_of_every_parameter_match_the_reference() -> None:
    layer = make_layer(n_shared_experts=1)
    x = torch.randn(3, 5, DIM, dtype=torch.float64)
    reference = make_layer(n_shared_experts=1)
    grad = torch.randn(3, 5, DIM, dtype=torch.float64)
    layer(x).backward(grad)
    reference_moe(reference, x).backward(grad)
    params = dict(reference.named_parameters())
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        assert rel(p.grad, params[name].grad) < FP64_BOUND, name


def test_group_limited_selection_keeps_only_the_best_groups() -> None:
    cfg = MoEConfig(num_experts=8, top_k=2, n_group=4, topk_group=2, score_function="sigmoid")
    # Groups (pairs): sums of their top two = 0.3, 1.5, 0.2, 1.0: groups 1 and 3 win, although
    # expert 0 alone (0.25) beats expert 6 (0.1).
    select = torch.tensor([[0.25, 0.05, 0.9, 0.6, 0.1, 0.1, 0.1, 0.9]])
    masked = group_limited_mask(select, cfg)
    assert torch.isinf(masked[0, [0, 1, 4, 5]]).all()
    assert torch.equal(masked[0, [2, 3, 6, 7]], select[0, [2, 3, 6, 7]])
    softmax_cfg = MoEConfig(num_experts=8, top_k=2, n_group=4, topk_group=1)
    # softmax ranks groups by their maximum: group 1 (0.9) ties group 3 (0.9); topk keeps one.
    kept = ~torch.isinf(group_limited_mask(select, softmax_cfg))
    assert kept.sum() == 2


def test_switch_aux_loss_is_the_coefficient_when_balanced_and_larger_when_not() -> None:
    tokens, experts, top_k = 8, 4, 2
    flat = torch.full((tokens, experts), 1 / experts, dtype=torch.float64)
    balanced = torch.full((experts,), tokens * top_k // experts)
    assert switch_aux_loss(flat, balanced, top_k, 0.01).item() == pytest.approx(0.01, rel=1e-12)
    skewed_probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]], dtype=torch.float64).repeat(tokens, 1)
    skewed = torch.tensor([8, 4, 2, 2])
    # E·Σ f·P = 4·(0.5·0.7 + 0.25·0.1 + 0.125·0.1 + 0.125·0.1) = 1.6
    assert switch_aux_loss(skewed_probs, skewed, top_k, 1.0).item() == pytest.approx(1.6, rel=1e-12)


def test_sequence_aux_loss_against_a_hand_computation() -> None:
    # Two sequences of two tokens, 4 experts, top-1. Sequence 0 sends both tokens to expert 0;
    # sequence 1 one token to expert 1 and one to expert 2.
    probs = torch.tensor(
        [[0.4, 0.2, 0.2, 0.2], [0.6, 0.2, 0.1, 0.1], [0.1, 0.5, 0.3, 0.1], [0.1, 0.2, 0.6, 0.1]],
        dtype=torch.float64,
    )
    indices = torch.tensor([[0], [0], [1], [2]])
    # Sequence 0: f = E/(K·S)·n = 4/2·[2,0,0,0] = [4,0,0,0]; P = [0.5, 0.2, 0.15, 0.15] -> 2.0
    # Sequence 1: f = 2·[0,1,1,0] = [0,2,2,0]; P = [0.1, 0.35, 0.45, 0.1] -> 0.7 + 0.9 = 1.6
    expected = 0.1 * (2.0 + 1.6) / 2
    assert sequence_aux_loss(probs, indices, 2, 0.1).item() == pytest.approx(expected, rel=1e-12)


def test_bias_update_sign_and_magnitude() -> None:
    counts = torch.tensor([10, 2, 6, 6])  # mean 6
    step = bias_update(counts, 1e-3)
    assert step.tolist() == pytest.approx([-1e-3, 1e-3, 0.0, 0.0])


def test_aux_free_bias_moves_from_the_steps_counts_and_steers_selection() -> None:
    layer = make_layer(balancing="aux_free", bias_update_rate=0.01, score_function="sigmoid")
    layer.router.weight.data.normal_(0, 0.02)
    x = torch.randn(8, 16, DIM, dtype=torch.float64) + 1.0
    layer.router.weight.data[:2] += 0.02  # experts 0 and 1 favoured by every token: skewed start
    layer(x)
    counts = layer.router.step_counts.clone()
    assert counts.sum() == 8 * 16 * 2
    update_expert_biases(layer)
    expected = bias_update(counts, 0.01)
    assert torch.equal(layer.router.expert_bias, expected.to(layer.router.expert_bias.dtype))
    assert expected[0] < 0  # the overloaded expert is pushed down
    assert layer.router.step_counts.sum() == 0  # reset for the next step
    before = max_violation(counts)
    assert before > 1.0
    for _ in range(40):
        layer(x)
        update_expert_biases(layer)
    layer(x)
    assert max_violation(layer.router.step_counts) < before / 4


def test_bias_counts_skip_recomputation_and_evaluation() -> None:
    layer = make_layer(balancing="aux_free")
    x = torch.randn(2, 6, DIM, dtype=torch.float64, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # forward runs twice
    assert layer.router.step_counts.sum() == 2 * 6 * 2
    layer.eval()
    with torch.no_grad():
        layer(x)
    assert layer.router.step_counts.sum() == 2 * 6 * 2


def test_capacity_drops_later_tokens_and_counts_them() -> None:
    # 6 tokens, top-1, 3 experts, factor 1: capacity ceil(6/3) = 2. Expert 0 gets tokens
    # 0, 1, 3, 5: tokens 3 and 5 are dropped (token order).
    indices = torch.tensor([[0], [0], [1], [0], [2], [0]])
    assert expert_capacity(6, 1, 3, 1.0) == 2
    plan = permute_plan(indices, 3, capacity_factor=1.0)
    assert plan.order_N.tolist() == [0, 1, 2, 4]
    assert plan.group_sizes_E.tolist() == [2, 1, 1]
    assert int(plan.dropped) == 2
    padded = permute_plan(indices, 3, capacity_factor=1.0, pad_to_capacity=True)
    assert padded.group_sizes_E.tolist() == [2, 2, 2]
    assert padded.rows_N.tolist() == [0, 1, 2, 4]


def test_padding_to_capacity_changes_nothing_but_the_shapes() -> None:
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    dropping = make_layer(capacity_factor=0.75)
    padded = make_layer(capacity_factor=0.75, pad_to_capacity=True)
    y = dropping(x)
    assert dropping.load_stats.dropped_fraction > 0
    assert rel(padded(x), y) < FP64_BOUND
    dropless = make_layer()
    assert rel(dropless(x), y) > 1e-3  # dropping changed the output


def test_z_loss_and_logged_extras() -> None:
    layer = make_layer(z_loss_coeff=1e-3)
    x = torch.randn(2, 4, DIM, dtype=torch.float64)
    layer(x)
    logits = x.reshape(-1, DIM) @ layer.router.weight.double().T
    expected = 1e-3 * torch.logsumexp(logits, -1).square().mean()
    total, logged = collect_aux_losses(layer)
    assert rel(logged["moe_z_loss"], expected) < FP64_BOUND
    assert total.requires_grad
    assert set(logged) == {"moe_aux_loss", "moe_z_loss", "moe_max_vio", "moe_dropped"}
    assert layer.aux_losses == {}  # released after collection


def test_global_load_summary_finds_dead_experts() -> None:
    from mt_parallel.moe import global_load_summary

    load = global_load_summary({"a": torch.tensor([4, 4, 4, 4]), "b": torch.tensor([8, 0, 4, 4])})
    assert load["max_vio"] == pytest.approx(1.0)  # layer b: 8 / 4 - 1
    assert load["dead"] == {"b": [1]}


def test_max_violation() -> None:
    assert max_violation(torch.tensor([4, 4, 4, 4])).item() == 0.0
    assert max_violation(torch.tensor([8, 4, 2, 2])).item() == pytest.approx(1.0)


@pytest.mark.parametrize("sizes", [[5, 0, 11, 16], [0, 0, 32, 0]], ids=["uneven", "one-expert"])
def test_grouped_mm_matches_the_loop(sizes: list[int]) -> None:
    # fp32 on the CPU: the grouped kernel and F.linear reduce over K=16 in possibly different
    # orders; 16 products of O(1) values differ by a few fp32 ulps (u = 6e-8): 1e-5 bound.
    torch.manual_seed(0)
    x = torch.randn(sum(sizes), 16, requires_grad=True)
    w = torch.randn(len(sizes), 8, 16, requires_grad=True)
    group_sizes = torch.tensor(sizes)
    y = grouped_mm(x, w, group_sizes)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_loop = looped_mm(x2, w2, sizes)
    assert rel(y, y_loop) < 1e-5
    grad = torch.randn_like(y)
    y.backward(grad)
    y_loop.backward(grad)
    assert rel(x.grad, x2.grad) < 1e-5
    assert rel(w.grad, w2.grad) < 1e-5


def test_looped_mm_builds_the_weight_gradient_once() -> None:
    # Indexing the stack per expert made each index's backward write a zero tensor of the whole
    # stack and add into it (2E whole-stack tensors); unbind's backward stacks them once.
    from torch.utils._python_dispatch import TorchDispatchMode

    w = torch.randn(16, 8, 16, requires_grad=True)
    whole_stack = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            whole_stack.extend(func for t in (out,) if getattr(t, "shape", None) == w.shape)
            return out

    sizes = [4 * (e % 3) for e in range(16)]
    y = looped_mm(torch.randn(sum(sizes), 16), w, sizes)
    with Record():
        y.sum().backward()
    assert w.grad is not None and len(whole_stack) <= 2, whole_stack


DEFERRED_CASES = {
    "fp32-grouped": (torch.float32, None, False),
    "bf16-autocast-grouped": (torch.float32, torch.bfloat16, False),
    "fp32-padded": (torch.float32, None, True),
    "fp64-loop": (torch.float64, None, False),
}


@pytest.mark.parametrize("case", DEFERRED_CASES.values(), ids=DEFERRED_CASES.keys())
def test_deferred_expert_weight_gradients_equal_the_plain_ones(
    monkeypatch: pytest.MonkeyPatch, case: tuple[torch.dtype, torch.dtype | None, bool]
) -> None:
    """With a ``wgrad_sink`` (zero-bubble pipelines) the experts' backward leaves the weights
    without gradient and queues them; run, they equal the plain backward's bit for bit, over
    two micro-batches, an idle expert included: the grouped GEMM (fp32, bf16 autocast on fp32
    weights, the CUDA padded layout forced on the CPU) and the per-expert loop (fp64). Every
    tensor a queued closure reaches is among the ones its ``holds`` names."""
    from mt_fp8 import WeightGradSink
    from mt_fp8.testing import watch_unheld
    from mt_parallel.moe import experts as experts_module
    from mt_parallel.moe.experts import GroupedExperts

    dtype, autocast, padded = case
    monkeypatch.setattr(experts_module, "pads_groups", lambda device: padded)
    torch.manual_seed(0)
    module = GroupedExperts(4, 32, 48, 0.05, 0.05).to(dtype)
    sizes_L = torch.tensor([5, 0, 11, 17])
    xs = [torch.randn(int(sizes_L.sum()), 32, dtype=dtype) for _ in range(2)]
    dys = [torch.randn(int(sizes_L.sum()), 32, dtype=dtype) for _ in range(2)]

    def run(sink: WeightGradSink | None) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        for proj in (module.gate_proj, module.up_proj, module.down_proj):
            proj.wgrad_sink = sink
        unheld = [] if sink is None else watch_unheld(sink, module.parameters())
        dxs = []
        for x, dy in zip(xs, dys, strict=True):
            x = x.clone().requires_grad_()
            with torch.autocast(
                "cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None
            ):
                y = module(x, sizes_L)
            y.backward(dy.to(y.dtype))
            dxs.append(x.grad)
        if sink is not None:
            assert all(p.grad is None for p in module.parameters())  # nothing before W
            assert len(sink) == 6 and unheld == [0] * 6  # three projections, two micro-batches
            sink.take()()
            assert not any(p.grad.requires_grad for p in module.parameters())  # no graph
        return [*dxs, *(p.grad for p in module.parameters())]

    plain, deferred = run(None), run(WeightGradSink())
    for a, b in zip(plain, deferred, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(deferred[2][1], torch.zeros_like(deferred[2][1]))  # the idle expert


ROUTER_CASES = {
    "fp64": (torch.float64, torch.float64, False),
    "fp32-weight-bf16-input": (torch.float32, torch.bfloat16, False),
    "bf16-weight-fp32-input": (torch.bfloat16, torch.float32, False),
    "fp64-recomputed": (torch.float64, torch.float64, True),
}


@pytest.mark.parametrize("case", ROUTER_CASES.values(), ids=ROUTER_CASES.keys())
def test_deferred_router_weight_gradient_equals_the_plain_one(
    case: tuple[torch.dtype, torch.dtype, bool],
) -> None:
    """With a ``wgrad_sink`` (zero-bubble pipelines) the router's backward gives ``dx`` and
    queues ``dW``: the weight has no gradient until the queue runs, and then the same as the
    plain backward's bit for bit, over two micro-batches (accumulated), in float64, with a
    low-precision input or weight (the casts to fp32 and back), and under recompute (the
    forward runs twice, the closure is queued once). Every tensor a queued closure reaches is
    among the ones its ``holds`` names."""
    from mt_fp8 import WeightGradSink
    from mt_fp8.testing import watch_unheld

    weight_dtype, x_dtype, recomputed = case
    layer = make_layer(z_loss_coeff=1e-2)
    router = layer.router.to(weight_dtype)
    xs = [torch.randn(2, 6, DIM, dtype=torch.float64).to(x_dtype) for _ in range(2)]
    gs = [torch.randn(12, 2, dtype=torch.float64) for _ in range(2)]

    def loss_of(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        routing = router(x)
        return (routing.weights_TK * g).sum() + routing.aux_loss + routing.z_loss

    def run(sink: WeightGradSink | None) -> list[torch.Tensor]:
        router.weight.grad, router.wgrad_sink = None, sink
        unheld = [] if sink is None else watch_unheld(sink, router.parameters())
        dxs = []
        for x, g in zip(xs, gs, strict=True):
            x = x.clone().requires_grad_()
            loss = checkpoint(loss_of, x, g, use_reentrant=False) if recomputed else loss_of(x, g)
            loss.backward()
            dxs.append(x.grad)
        if sink is not None:
            assert router.weight.grad is None and len(sink) == 2  # one closure a micro-batch
            assert unheld == [0, 0]
            sink.take()()
            assert not router.weight.grad.requires_grad  # no graph, as autograd's
            assert len(sink) == 0
        return [*dxs, router.weight.grad]

    plain, deferred = run(None), run(WeightGradSink())
    assert plain[-1].abs().max() > 0
    for a, b in zip(plain, deferred, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_padded_layout_of_the_cuda_grouped_gemm() -> None:
    from mt_parallel.moe.experts import PaddedLayout

    layout = PaddedLayout.of(torch.tensor([5, 0, 11, 16]), rows=32, align=16)
    assert layout.dest_M.tolist() == [*range(5), *range(16, 27), *range(32, 48)]
    # The buffer holds any layout of 32 rows in 4 groups: 32 + 4·15 rows, known on the host.
    assert layout.ends_L.tolist() == [16, 16, 32, 48] and layout.rows == 92


def test_experts_padded_once_match_the_unpadded_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's single padding of the whole expert MLP (forced here on the CPU, whose
    grouped GEMM takes aligned offsets too) gives the unpadded experts' outputs and gradients,
    also when the rows past the groups hold NaN."""
    from mt_parallel.moe import experts as experts_module
    from mt_parallel.moe.experts import GroupedExperts

    torch.manual_seed(0)
    module = GroupedExperts(4, 32, 48, 0.05, 0.05)
    sizes_L = torch.tensor([5, 0, 11, 17])
    x = torch.randn(int(sizes_L.sum()), 32, requires_grad=True)
    dy = torch.randn(x.shape)

    poisoned = poison_rows_past_the_groups(experts_module.padded_grouped_mm)

    def run(padded: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(experts_module, "pads_groups", lambda device: padded)
        monkeypatch.setattr(experts_module, "padded_grouped_mm", poisoned)
        module.zero_grad(set_to_none=True)
        x.grad = None
        pads = []
        monkeypatch.setattr(
            experts_module.PaddedLayout, "pad", lambda self, t, f=experts_module.PaddedLayout.pad:
            pads.append(t.shape) or f(self, t),
        )  # fmt: skip
        y = module(x, sizes_L)
        y.backward(dy)
        assert len(pads) == (1 if padded else 0), pads  # one padding for the three projections
        return [y, x.grad, *(p.grad for p in module.parameters())]

    padded, unpadded = run(True), run(False)
    assert all(t.isfinite().all() for t in padded)  # no NaN of the rows past the groups got in
    # Same fp32 products and SwiGLU per real row; the zero rows add exact zeros to the weight
    # gradients. Only the kernels' blocking over the longer padded groups may reorder the fp32
    # sums: a few ulps of the largest entry.
    for a, b in zip(padded, unpadded, strict=True):
        assert rel(a, b) < 1e-6


@pytest.mark.parametrize(
    ("capacity_factor", "pad", "folded"),
    [(None, False, True), (1.0, False, True), (1.0, True, False)],
    ids=["dropless", "dropping", "padded-to-capacity"],
)
def test_permutation_writes_the_experts_padded_groups(
    monkeypatch: pytest.MonkeyPatch, capacity_factor: float | None, pad: bool, folded: bool
) -> None:
    """At ep = 1 the permutation lays the rows out in the experts' padded groups (forced here
    on the CPU, whose grouped GEMM takes aligned offsets too) and the experts skip their own
    pad/unpad: same output and gradients as the unpadded layer, also with NaN in the rows past
    the groups. Padding to capacity keeps its own layout (the experts pad it)."""
    from mt_parallel.moe import experts as experts_module

    layer = make_layer(n_shared_experts=1, capacity_factor=capacity_factor, pad_to_capacity=pad)
    layer = layer.float()
    x = torch.randn(2, 9, DIM)
    poisoned = poison_rows_past_the_groups(experts_module.padded_grouped_mm)
    monkeypatch.setattr(experts_module, "padded_grouped_mm", poisoned)

    def run(padded: bool) -> tuple[list[torch.Tensor], int]:
        monkeypatch.setattr(experts_module, "pads_groups", lambda device: padded)
        pads = []
        monkeypatch.setattr(
            experts_module.PaddedLayout, "pad", lambda self, t, f=experts_module.PaddedLayout.pad:
            pads.append(t.shape) or f(self, t),
        )  # fmt: skip
        layer.zero_grad(set_to_none=True)
        x_leaf = x.clone().requires_grad_()
        y = layer(x_leaf)
        y.backward(torch.ones_like(y))
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        return [y, x_leaf.grad, *grads], len(pads)

    (padded, pads), (unpadded, _) = run(True), run(False)
    assert pads == (0 if folded else 1)
    for a, b in zip(padded, unpadded, strict=True):
        assert a.isfinite().all()
        # Same fp32 products per real row (see test_experts_padded_once_match_the_unpadded_experts).
        assert rel(a, b) < 1e-6


def test_fp32_layer_takes_the_grouped_path_and_matches_fp64() -> None:
    layer = make_layer()
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    expected = layer(x)
    # fp32 compute of the same weights: chains of length-32 dot products in fp32 (u = 6e-8),
    # relative error well under 1e-5.
    assert rel(layer.float()(x.float()).double(), expected) < 1e-5


BAD = {
    "top_k > experts": ({"num_experts": 4, "top_k": 5}, "top_k=5 exceeds moe.num_experts=4"),
    "capacity <= 0": ({"capacity_factor": 0.0}, "capacity_factor=0.0 must be > 0"),
    "n_group": ({"num_experts": 8, "n_group": 3}, "n_group=3 does not divide"),
    "topk_group": ({"n_group": 2, "topk_group": 3}, "topk_group=3 exceeds moe.n_group=2"),
    "balancing": ({"balancing": "bogus"}, "valid: aux_loss, seq_aux_loss, aux_free, none"),
    "pad": ({"pad_to_capacity": True}, "pad_to_capacity=true needs a moe.capacity_factor"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_configurations_name_the_values(case: tuple[dict, str]) -> None:
    overrides, message = case
    with pytest.raises(ValueError, match=re.escape(message)):
        MoEConfig(**overrides)


def test_ep_must_divide_the_experts() -> None:
    with pytest.raises(
        ValueError, match=re.escape("parallel.ep=3 does not divide moe.num_experts=8")
    ):
        MoEConfig(num_experts=8).check_expert_parallel(3)


def test_expert_parallel_composes_with_every_data_parallel_mode_but_not_compile() -> None:
    from mt_parallel import ParallelConfig
    from mt_parallel.config import DATA_PARALLEL_MODES

    for mode in DATA_PARALLEL_MODES:  # the world-4 tests train each of them at ep=2
        assert ParallelConfig(ep=2, data_parallel=mode).ep == 2
    with pytest.raises(ValueError, match=re.escape("parallel.ep=2 with parallel.compile=true")):
        ParallelConfig(ep=2, compile=True)


def test_fp8_runs_the_experts_grouped_linears_on_their_own_weights() -> None:
    import mt_fp8
    import mt_parallel as mp

    torch.manual_seed(0)
    layer = MoE(DIM, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32, n_shared_experts=1))
    x = torch.randn(2, 8, DIM)
    expected = layer(x).detach()
    weights = {n: p for n, p in layer.named_parameters()}
    mp.apply_fp8(layer, mt_fp8.recipe_from_name("rowwise"))
    experts = layer.experts
    assert all(p.fp8_enabled for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    assert layer.shared_experts.gate_proj.fp8_enabled
    assert dict(layer.named_parameters()) == weights  # shared, not copied; the router unchanged
    y = layer(x)
    y.sum().backward()
    assert experts.gate_proj.weight.grad is not None and layer.router.weight.grad is not None
    # FP8 changed the numbers (E4M3 operands: ~2^-4 relative per element), but not grossly:
    # a wrong expert or weight would move the output by O(1) of its size.
    error = rel(y, expected)
    assert 0 < error < 0.25, error


def test_fp8_min_features_keeps_small_expert_projections_high_precision() -> None:
    import mt_fp8
    import mt_parallel as mp

    layer = MoE(64, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32))
    plan = mp.ParallelizePlan(block_types=())
    options = mp.FP8Options(recipe=mt_fp8.recipe_from_name("rowwise"), min_features=48)
    mp.apply_fp8_options(layer, plan, options)
    experts = layer.experts
    # Every projection has a side of 32 < 48 (FFN 32, width 64): all stay high precision.
    assert not any(p.fp8_enabled for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    mp.apply_fp8_options(layer, plan, mp.FP8Options(recipe=options.recipe, min_features=32))
    assert all(p.fp8_enabled for p in (experts.gate_proj, experts.up_proj, experts.down_proj))


def test_expert_formats_pick_e4m3_gradients_for_per_row_recipes_only() -> None:
    import mt_fp8
    import mt_parallel as mp

    e4m3, hybrid = mt_fp8.FormatConfig.all_e4m3(), mt_fp8.FormatConfig.hybrid()
    rowwise, tensorwise = mt_fp8.recipe_from_name("rowwise"), mt_fp8.recipe_from_name("tensorwise")
    assert rowwise.formats == hybrid and tensorwise.formats == hybrid
    assert mp.expert_recipe(rowwise).formats == e4m3
    assert mp.expert_recipe(mt_fp8.recipe_from_name("delayed")).formats == hybrid
    assert mp.expert_recipe(tensorwise) is tensorwise
    assert mp.expert_recipe(tensorwise, "e4m3").formats == e4m3
    assert mp.expert_recipe(rowwise, "recipe") is rowwise
    with pytest.raises(ValueError, match=r"expert_formats='e5m2' is unknown; valid: auto, e4m3"):
        mp.FP8Options(recipe=rowwise, expert_formats="e5m2")

    # In a layer: the routed experts take E4M3 gradients, the shared expert keeps the recipe's.
    layer = MoE(64, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=64, n_shared_experts=1))
    mp.apply_fp8_options(layer, mp.ParallelizePlan(block_types=()), mp.FP8Options(rowwise))
    assert layer.experts.gate_proj._fp8.recipe.formats == e4m3
    shared = [m for m in layer.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert shared and all(m.fp8_enabled and m._fp8.recipe.formats == hybrid for m in shared)
