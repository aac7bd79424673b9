"""FP8Linear / FP8GroupedLinear against float64 nn.Linear, for every recipe.

Bound (per output element, float64): if each operand element is off by at most
``e(v) = eps·|v| + delta`` then ``|Σ a'b' - Σ ab| <= Σ (e(a)|b| + |a|e(b) + e(a)e(b))``, plus
``K·2^-24·Σ|a'||b'|`` for the fp32 accumulation and output. Per role, ``eps`` is the mantissa
bound 2^-(m+1) (E4M3 2^-4 for input and weight, E5M2 2^-3 for gradients); MXFP8 can also clip the
top of a block by up to 1 - fmt.max / 2^(emax+1) (1/8 for both formats), so its eps is 1/8.
``delta`` covers the subnormal range: half the subnormal spacing times the largest scale,
``amax · min_subnormal / (2 · fmt.max)`` for amax scaling (amax of the whole tensor bounds every
block's), and ``amax · 2^-emax · min_subnormal / 2`` for MX (its scale is at most
``amax / 2^emax``).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import mt_fp8.gemm as gemm_module
from mt_fp8 import (
    FP8_GEMMS,
    BlockScaling,
    DelayedScaling,
    FP8Format,
    FP8GroupedLinear,
    FP8Linear,
    LinearPlan,
    MXFP8Scaling,
    RowwiseScaling,
    TensorRole,
    TensorwiseScaling,
    WeightGradSink,
    final_micro_batch,
    fp8_autocast,
    fp8_health,
    fp8_saturation_summary,
    reset_fp8_health,
    tie_input_scales,
    update_fp8_scales,
)
from mt_fp8.ops import swiglu
from mt_fp8.testing import watch_unheld

RECIPES = [DelayedScaling(), TensorwiseScaling(), RowwiseScaling(), BlockScaling(), MXFP8Scaling()]
M, K, N = 200, 256, 384  # M is not a multiple of 128: exercises the wgrad padding


def element_error(v: torch.Tensor, fmt: FP8Format, mx: bool) -> torch.Tensor:
    amax = v.abs().max()
    if mx:
        return v.abs() / 8 + amax * 2.0**-fmt.emax * fmt.min_subnormal / 2
    return fmt.relative_rounding_error * v.abs() + amax * fmt.min_subnormal / (2 * fmt.max)


def product_bound(a, fmt_a, b, fmt_b, mx):
    e_a, e_b = element_error(a, fmt_a, mx), element_error(b, fmt_b, mx)
    bound = e_a @ b.abs().t() + a.abs() @ e_b.t() + e_a @ e_b.t()
    return bound + a.shape[1] * 2**-24 * ((a.abs() + e_a) @ (b.abs() + e_b).t())


def run_layer(recipe, backend="auto", seed=0):
    torch.manual_seed(seed)
    layer = FP8Linear(K, N, recipe=recipe, backend=backend)
    x = torch.randn(M, K)
    dy = torch.randn(M, N)
    if isinstance(recipe, DelayedScaling):
        # Step 1 runs with unit scales (saturating); the compared step uses scales from its amax.
        layer(x.requires_grad_()).backward(dy)
        update_fp8_scales(layer, recipe)
        layer.zero_grad()
    x = x.detach().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return layer, x, dy, y


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_forward_and_backward_against_float64_linear(recipe):
    layer, x, dy, y = run_layer(recipe)
    mx = isinstance(recipe, MXFP8Scaling)
    x64, dy64 = x.detach().double(), dy.double()
    w64, b64 = layer.weight.detach().double(), layer.bias.detach().double()
    e4, e5 = FP8Format.E4M3, FP8Format.E5M2

    assert ((y.double() - (x64 @ w64.t() + b64)).abs() <= product_bound(x64, e4, w64, e4, mx)).all()
    dx_bound = product_bound(dy64, e5, w64.t().contiguous(), e4, mx)
    assert ((x.grad.double() - dy64 @ w64).abs() <= dx_bound).all()
    dw_bound = product_bound(dy64.t().contiguous(), e5, x64.t().contiguous(), e4, mx)
    assert ((layer.weight.grad.double() - dy64.t() @ x64).abs() <= dw_bound).all()
    # Bias gradient: an fp32 sum of M values, error <= M·2^-24·Σ|dy|.
    db_bound = M * 2**-24 * dy64.abs().sum(0)
    assert ((layer.bias.grad.double() - dy64.sum(0)).abs() <= db_bound).all()


@pytest.mark.parametrize("recipe", [TensorwiseScaling(), RowwiseScaling()], ids=lambda r: r.name)
def test_scaled_mm_and_emulated_paths_agree(recipe):
    if isinstance(recipe, RowwiseScaling) and not gemm_module.cpu_scaled_mm_takes_rowwise():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no rowwise scales")
    fast = run_layer(recipe, backend="scaled_mm")
    slow = run_layer(recipe, backend="emulate")
    # Identical FP8 operands; only fp32 summation order differs: K·2^-24 relative to Σ|ab|.
    for a, b in ((fast[3], slow[3]), (fast[1].grad, slow[1].grad)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    assert torch.allclose(fast[0].weight.grad, slow[0].weight.grad, rtol=1e-4, atol=1e-3)


def test_saves_fp8_input_not_high_precision():
    layer = FP8Linear(K, N, recipe=RowwiseScaling())
    x = torch.randn(M, K, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    dtypes = {t.dtype for t in saved}
    assert dtypes <= {torch.float8_e4m3fn, torch.float32}
    assert all(t.dtype != torch.float32 or t.shape[-1] == 1 for t in saved)  # fp32 = scales only


def test_fp8_weight_is_cached_across_microbatches_and_refreshed_after_step():
    layer = FP8Linear(K, N, recipe=TensorwiseScaling())
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(8, K)
    layer(x).sum().backward()
    first = layer.fp8_weight_cache.entry.weight
    layer(x).sum().backward()  # second micro-batch: same FP8 weight object
    assert layer.fp8_weight_cache.entry.weight is first
    optimizer.step()  # in-place update bumps weight._version
    layer(x).sum().backward()
    assert layer.fp8_weight_cache.entry.weight is not first


def test_final_micro_batch_frees_the_cached_weight_after_backward():
    layer = FP8Linear(K, N, recipe=TensorwiseScaling())
    x = torch.randn(8, K)
    layer(x).sum().backward()  # an earlier micro-batch: the entry stays for the next one
    kept = layer.fp8_weight_cache.entry.weight
    with final_micro_batch():
        y = layer(x)
        assert layer.fp8_weight_cache.entry.weight is kept  # the forward still reuses it
        y.sum().backward()
    assert layer.fp8_weight_cache.entry is None


def test_final_micro_batch_under_recompute_quantizes_the_weight_once(monkeypatch):
    # The recomputed forward runs right before the layer's backward and still finds the entry.
    layer = FP8Linear(K, N, recipe=TensorwiseScaling())
    x = torch.randn(8, K, requires_grad=True)
    reference = layer(x)
    reference.sum().backward()
    expected_dx, expected_dw = x.grad.clone(), layer.weight.grad.clone()
    x.grad, layer.weight.grad = None, None
    layer.fp8_weight_cache.clear()
    calls = []
    original = LinearPlan.quantize

    def counting(self, x_RC, role, record, transposed=False):
        calls.append(role)
        return original(self, x_RC, role, record, transposed)

    monkeypatch.setattr(LinearPlan, "quantize", counting)
    with final_micro_batch():
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        y.sum().backward()
    assert calls.count(TensorRole.WEIGHT) == 1
    assert layer.fp8_weight_cache.entry is None
    torch.testing.assert_close(y, reference, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, expected_dx, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, expected_dw, rtol=0, atol=0)


def test_weight_cache_can_be_turned_off():
    # What FSDP2 needs (mt_fp8.linear: weight cache): every call quantizes the weight afresh.
    layer = FP8Linear(K, N, bias=False, recipe=TensorwiseScaling())
    layer.cache_weight = False
    x = torch.randn(8, K)
    with torch.no_grad():
        before = layer(x)
        # A write the version-keyed cache would not see; doubling is exact in FP8 (same codes,
        # twice the scale), so the output doubles exactly.
        layer.weight.data.mul_(2)
        after = layer(x)
    assert layer.fp8_weight_cache.entry is None
    torch.testing.assert_close(after, 2 * before, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_layers_reading_one_input_share_its_quantization(recipe):
    """q/k/v-style layers on one tensor: outputs, every gradient and the health counts equal
    those of layers fed separate copies, and (current scaling) the FP8 ``xᵀ`` they save for
    backward is one tensor; delayed scaling with per-layer scales (untied) never shares."""
    torch.manual_seed(0)
    layers = [FP8Linear(K, N, recipe=recipe) for _ in range(3)]
    twins = [FP8Linear(K, N, recipe=recipe) for _ in range(3)]
    for layer, twin in zip(layers, twins, strict=True):
        twin.load_state_dict(layer.state_dict())
    x = torch.randn(M, K, requires_grad=True)
    x_copies = [x.detach().clone().requires_grad_() for _ in range(3)]
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outputs = [layer(x) for layer in layers]
    sum(out.square().sum() for out in outputs).backward()
    twin_outputs = [twin(xc) for twin, xc in zip(twins, x_copies, strict=True)]
    sum(out.square().sum() for out in twin_outputs).backward()
    for out, twin_out in zip(outputs, twin_outputs, strict=True):
        assert torch.equal(out, twin_out)
    # Same three fp32 terms; autograd may add them in another order than sum() (fp32 rounding).
    torch.testing.assert_close(x.grad, sum(xc.grad for xc in x_copies), rtol=1e-6, atol=1e-6)
    for layer, twin in zip(layers, twins, strict=True):
        assert torch.equal(layer.weight.grad, twin.weight.grad)
        assert torch.equal(layer.fp8_meta.health, twin.fp8_meta.health)
    # xᵀ is (K, M or M padded); wᵀ is (K, N).
    fp8_input_t = [t for t in saved if t.dtype == torch.float8_e4m3fn and t.shape[1] != N]
    distinct = {t.data_ptr() for t in fp8_input_t}
    assert len(distinct) == (3 if isinstance(recipe, DelayedScaling) else 1)


def test_tied_delayed_input_scales_quantize_the_shared_input_once(monkeypatch):
    """Delayed scaling with tied INPUT scales (mt_fp8.state): q/k/v-style layers quantize their
    common input once per forward and give the same bits as untied layers fed separate copies,
    also on later steps whose scales come from the amax history (the input grows each step, so
    the history's scale differs from the current one)."""
    torch.manual_seed(0)
    recipe = DelayedScaling()
    layers = nn.ModuleList(FP8Linear(K, N, recipe=recipe) for _ in range(3))
    twins = nn.ModuleList(FP8Linear(K, N, recipe=recipe) for _ in range(3))
    twins.load_state_dict(layers.state_dict())
    tie_input_scales([layer.fp8_meta for layer in layers])
    assert all(layer.fp8_meta.input_meta is layers[0].fp8_meta for layer in layers)
    input_calls: list[object] = []
    quantize = LinearPlan.quantize

    def counting_quantize(plan, x, role, record, transposed=False):
        if role is TensorRole.INPUT:
            input_calls.append(plan.meta)
        return quantize(plan, x, role, record, transposed)

    monkeypatch.setattr(LinearPlan, "quantize", counting_quantize)
    for step in range(3):
        x = (torch.randn(M, K) * (1 + step)).requires_grad_()
        x_copies = [x.detach().clone().requires_grad_() for _ in range(3)]
        input_calls.clear()
        outputs = [layer(x) for layer in layers]
        assert len(input_calls) == 1
        sum(out.square().sum() for out in outputs).backward()
        twin_outputs = [twin(xc) for twin, xc in zip(twins, x_copies, strict=True)]
        sum(out.square().sum() for out in twin_outputs).backward()
        for layer, twin, out, twin_out in zip(layers, twins, outputs, twin_outputs, strict=True):
            assert torch.equal(out, twin_out)
            assert torch.equal(layer.weight.grad, twin.weight.grad)
        # The same three fp32 terms, possibly added in another order (fp32 rounding).
        torch.testing.assert_close(x.grad, sum(xc.grad for xc in x_copies), rtol=1e-6, atol=1e-6)
        update_fp8_scales(layers, recipe)
        update_fp8_scales(twins, recipe)
    owner = layers[0].fp8_meta
    assert torch.equal(owner.scale, twins[0].fp8_meta.scale)
    assert all(torch.equal(owner.scale[0], twin.fp8_meta.scale[0]) for twin in twins)
    # The other layers keep their own WEIGHT and GRAD_OUTPUT state and leave INPUT's unused.
    for layer, twin in zip(layers[1:], twins[1:], strict=True):
        assert torch.equal(layer.fp8_meta.scale[1:], twin.fp8_meta.scale[1:])
        assert not layer.fp8_meta.amax_history[:, int(TensorRole.INPUT)].any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_swiglu_down_projection_matches_swiglu_then_linear(recipe, device):
    """``forward_swiglu(g, u)`` gives the bits of ``layer(swiglu(g, u))``: output, the gradients
    of g, u, weight and bias, health counts and delayed-scaling state, over three steps (delayed:
    the later ones with history scales); of high-precision tensors it saves only g and u. On
    CUDA (and under ``TRITON_INTERPRET=1``) tensorwise scales take the fused SwiGLU quantizer."""
    torch.manual_seed(0)
    layer, twin = FP8Linear(K, N, recipe=recipe), FP8Linear(K, N, recipe=recipe)
    twin.load_state_dict(layer.state_dict())
    layer, twin = layer.to(device), twin.to(device)
    saved: list[torch.Tensor] = []
    for step in range(3):
        gate = (torch.randn(M, K) * (1 + step)).to(device).requires_grad_()
        up = torch.randn(M, K).to(device).requires_grad_()
        gate_copy, up_copy = (t.detach().clone().requires_grad_() for t in (gate, up))
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = layer.forward_swiglu(gate, up)
        y_twin = twin(swiglu(gate_copy, up_copy))
        dy = torch.randn(M, N).to(device)
        y.backward(dy)
        y_twin.backward(dy)
        assert torch.equal(y, y_twin)
        assert torch.equal(gate.grad, gate_copy.grad) and torch.equal(up.grad, up_copy.grad)
        assert torch.equal(layer.weight.grad, twin.weight.grad)
        assert torch.equal(layer.bias.grad, twin.bias.grad)
        assert torch.equal(layer.fp8_meta.health, twin.fp8_meta.health)
        # (M, K) tensors saved in more than one byte per element: gate and up, no product.
        activations = {t.data_ptr() for t in saved if t.shape == (M, K) and t.element_size() > 1}
        assert activations == {gate.data_ptr(), up.data_ptr()}
        if isinstance(recipe, DelayedScaling):
            update_fp8_scales(layer, recipe)
            update_fp8_scales(twin, recipe)
            assert torch.equal(layer.fp8_meta.scale, twin.fp8_meta.scale)
            assert torch.equal(layer.fp8_meta.amax_history, twin.fp8_meta.amax_history)


GEMM_SUBSETS = [
    ("forward",),
    ("dgrad",),
    ("wgrad",),
    ("forward", "dgrad"),
    ("forward", "wgrad"),
    ("dgrad", "wgrad"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("gemms", GEMM_SUBSETS, ids="+".join)
@pytest.mark.parametrize(
    "recipe", [TensorwiseScaling(), RowwiseScaling(), DelayedScaling()], ids=lambda r: r.name
)
def test_high_precision_gemms_match_nn_linear_and_fp8_ones_the_fp8_layer(recipe, gemms, device):
    """With ``fp8_gemms`` a subset, each FP8 GEMM gives the bits of an all-FP8 twin and each
    other GEMM the bits of ``nn.Linear`` under the same bf16 autocast; over two steps (delayed:
    the second with scales from the first's amaxes). SwiGLU input goes the unfused way."""
    torch.manual_seed(0)
    layer = FP8Linear(K, N, recipe=recipe, fp8_gemms=gemms)
    twin = FP8Linear(K, N, recipe=recipe)
    plain = nn.Linear(K, N)
    twin.load_state_dict(layer.state_dict())
    plain.load_state_dict({k: layer.state_dict()[k] for k in ("weight", "bias")})
    layer, twin, plain = layer.to(device), twin.to(device), plain.to(device)
    for step in range(2):
        gate = (torch.randn(M, K) * (1 + step)).to(device).requires_grad_()
        up = torch.randn(M, K).to(device).requires_grad_()
        dy = torch.randn(M, N).to(device)
        outputs, grads = [], []
        for module in (layer, twin, plain):
            g, u = (t.detach().clone().requires_grad_() for t in (gate, up))
            with torch.autocast(device, dtype=torch.bfloat16):
                y = layer.forward_swiglu(g, u) if module is layer else module(swiglu(g, u))
            y.backward(dy.to(y.dtype))
            outputs.append(y)
            grads.append((g.grad, module.weight.grad))
            module.zero_grad()
        twin_index = 1 if "forward" in gemms else 2
        assert torch.equal(outputs[0], outputs[twin_index])
        twin_index = 1 if "dgrad" in gemms else 2
        assert torch.equal(grads[0][0], grads[twin_index][0])
        twin_index = 1 if "wgrad" in gemms else 2
        assert torch.equal(grads[0][1], grads[twin_index][1])
        if isinstance(recipe, DelayedScaling):
            update_fp8_scales(layer, recipe)
            update_fp8_scales(twin, recipe)


def test_high_precision_wgrad_saves_the_input_and_names_bad_gemms():
    x = torch.randn(M, K, requires_grad=True)
    saved: list[torch.Tensor] = []
    for gemms, saves_x in ((("forward", "dgrad"), True), (("forward", "dgrad", "wgrad"), False)):
        saved.clear()
        layer = FP8Linear(K, N, recipe=TensorwiseScaling(), fp8_gemms=gemms)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            layer(x)
        assert any(t.data_ptr() == x.data_ptr() and t.dtype == x.dtype for t in saved) == saves_x
    assert "fp8_gemms=['dgrad', 'forward']" in repr(FP8Linear(K, N, fp8_gemms=["forward", "dgrad"]))
    with pytest.raises(
        ValueError, match=r"unknown GEMM names \['fwd'\]; valid: .*forward, dgrad, wgrad"
    ):
        FP8Linear(K, N, fp8_gemms=["fwd", "dgrad"])
    with pytest.raises(ValueError, match="names no GEMM"):
        FP8Linear(K, N, fp8_gemms=[])


def test_swiglu_down_projection_rejects_mismatched_inputs():
    layer = FP8Linear(K, N)
    with pytest.raises(ValueError, match=r"gate and up of one shape and dtype with 256 features"):
        layer.forward_swiglu(torch.randn(M, K), torch.randn(M, K + 16))
    with pytest.raises(ValueError, match=r"gate and up of one shape and dtype with 256 features"):
        layer.forward_swiglu(torch.randn(M, 2 * K), torch.randn(M, 2 * K))


def test_tie_input_scales_rejects_mismatched_metas():
    short = FP8Linear(K, N, recipe=DelayedScaling(amax_history_len=4)).fp8_meta
    long = FP8Linear(K, N, recipe=DelayedScaling(amax_history_len=16)).fp8_meta
    with pytest.raises(ValueError, match=r"amax history lengths differ \(16 and 4\)"):
        tie_input_scales([short, long])
    other = FP8Linear(K, N, recipe=DelayedScaling(amax_history_len=4)).fp8_meta
    tie_input_scales([short, other])
    with pytest.raises(ValueError, match="tied to another meta already"):
        tie_input_scales([other, short])


def test_autocast_bf16_and_bf16_parameters():
    layer = FP8Linear(K, N)
    x = torch.randn(4, 16, K, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 16, N)
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    bf16_layer = FP8Linear(K, N, dtype=torch.bfloat16)
    out = bf16_layer(torch.randn(8, K, dtype=torch.bfloat16))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and bf16_layer.weight.grad.dtype == torch.bfloat16


def test_fp8_autocast_disable_and_override():
    layer = FP8Linear(K, N, recipe=TensorwiseScaling())
    x = torch.randn(8, K)
    with fp8_autocast(enabled=False):
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    with fp8_autocast(recipe=BlockScaling()):
        blocked = layer(x)
    assert not torch.equal(blocked, layer(x))
    with pytest.raises(TypeError, match="takes an mt_fp8 Recipe"), fp8_autocast(recipe="block"):
        pass


def test_health_counts_saturation_under_delayed_scaling():
    layer = FP8Linear(K, N, recipe=DelayedScaling())
    layer(torch.randn(M, K))  # the first step scales currently and records amax ≈ 4
    update_fp8_scales(layer, layer.recipe)
    reset_fp8_health(layer)
    scale = layer.fp8_meta.scale[0]
    x = torch.randn(M, K) * 1000  # the history's scale (≈ 4 / 448) saturates most of it
    layer(x)
    health = fp8_health(layer)[""]
    expected = (x.abs() / scale >= FP8Format.E4M3.saturation_threshold).double().mean().item()
    assert expected > 0.5
    assert health["input"]["saturated"] == pytest.approx(expected)
    assert health["weight"]["saturated"] == 0.0
    model = nn.Sequential(layer, FP8Linear(N, K, recipe=DelayedScaling()))
    model(x)
    assert all(
        meta_counts.any() for meta_counts in (model[0].fp8_meta.health, model[1].fp8_meta.health)
    )
    reset_fp8_health(model)  # every layer's counters, in one call
    assert not model[0].fp8_meta.health.any() and not model[1].fp8_meta.health.any()
    assert fp8_health(model) == {"0": {}, "1": {}}


def test_saturation_summary_finds_the_worst_place_without_a_host_scan():
    """``fp8_saturation_summary`` gives the largest saturated fraction of :func:`fp8_health` and
    the first place holding it, and zeros when nothing saturated or there is no FP8 layer."""
    torch.manual_seed(0)
    model = nn.Sequential(*(FP8Linear(K, K, recipe=DelayedScaling()) for _ in range(3)))
    model(torch.randn(M, K))
    update_fp8_scales(model, DelayedScaling())
    reset_fp8_health(model)
    summary, places = fp8_saturation_summary(model)
    assert summary.tolist() == [0.0, 0.0] and len(places) == 9
    model[1].fp8_meta.health[int(TensorRole.WEIGHT)] = torch.tensor([3, 0, 10])
    model[2].fp8_meta.health[int(TensorRole.INPUT)] = torch.tensor([3, 0, 10])  # a tie: later
    model[0].fp8_meta.health[int(TensorRole.GRAD_OUTPUT)] = torch.tensor([1, 0, 10])
    summary, places = fp8_saturation_summary(model)
    fraction, index = summary.tolist()
    scanned = max(
        (health["saturated"], f"{name}:{role}")
        for name, roles in fp8_health(model).items()
        for role, health in roles.items()
    )
    assert fraction == scanned[0] == 0.3
    assert places[int(index)] == "1:weight"
    assert fp8_saturation_summary(nn.Linear(4, 4))[1] == []


def test_bad_dimensions_and_backend_messages():
    with pytest.raises(
        ValueError, match="in_features=100 and out_features=64 must both be divisible by 16"
    ):
        FP8Linear(100, 64)
    with pytest.raises(ValueError, match="divisible by 128 for FP8 GEMMs with the block recipe"):
        FP8Linear(64, 64, recipe=BlockScaling())
    with pytest.raises(ValueError, match="unknown FP8 GEMM backend 'cutlass'"):
        FP8Linear(64, 64, backend="cutlass")
    with pytest.raises(RuntimeError, match="backend 'fast' cannot run here"):
        FP8Linear(128, 128, recipe=BlockScaling(), backend="fast")(torch.randn(128, 128))


@pytest.mark.parametrize("recipe", [TensorwiseScaling(), BlockScaling()], ids=lambda r: r.name)
def test_grouped_linear_matches_per_expert_linears(recipe):
    torch.manual_seed(0)
    layer = FP8GroupedLinear(3, 128, 256, recipe=recipe)
    sizes = [70, 0, 130]
    x = torch.randn(sum(sizes), 128, requires_grad=True)
    dy = torch.randn(sum(sizes), 256)
    layer(x, sizes).backward(dy)
    start = 0
    for expert, size in enumerate(sizes):
        rows = slice(start, start + size)
        start += size
        if size == 0:
            assert torch.equal(
                layer.weight.grad[expert], torch.zeros_like(layer.weight.grad[expert])
            )
            continue
        x64, dy64 = x.detach()[rows].double(), dy[rows].double()
        w64 = layer.weight.detach()[expert].double()
        # Same per-element bound as the FP8Linear test, per expert.
        e4, e5 = FP8Format.E4M3, FP8Format.E5M2
        bound = product_bound(dy64.t().contiguous(), e5, x64.t().contiguous(), e4, False)
        assert ((layer.weight.grad[expert].double() - dy64.t() @ x64).abs() <= bound).all()
        assert (
            (x.grad[rows].double() - dy64 @ w64).abs()
            <= product_bound(dy64, e5, w64.t().contiguous(), e4, False)
        ).all()
    with pytest.raises(ValueError, match="must be 3 non-negative ints summing to the 200 tokens"):
        layer(x, [100, 100])


@pytest.mark.parametrize("recipe", [TensorwiseScaling(), RowwiseScaling(), DelayedScaling()])
def test_runs_eagerly_inside_compiled_models(recipe):
    """FP8 layers keep out of compiled graphs (mt_fp8.linear's NOTE): Dynamo breaks the graph
    around the layer, and the compiled model (through AOTAutograd) gives the eager outputs and
    gradients exactly."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(128, 128)
            self.fp8 = FP8Linear(128, 96, recipe=recipe)

        def forward(self, x):
            return torch.tanh(self.fp8(torch.nn.functional.gelu(self.linear(x))))

    torch.manual_seed(0)
    model = Block()
    x = torch.randn(64, 128, requires_grad=True)

    def run(module):
        for p in (x, *model.parameters()):
            p.grad = None
        y = module(x)
        (y * torch.linspace(-1, 1, 96)).sum().backward()
        return [y.detach(), x.grad, *(p.grad for p in model.parameters())]

    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append([type(node.target).__name__ for node in graph_module.graph.nodes])
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    eager = run(model)
    torch._dynamo.reset()
    compiled = run(torch.compile(model, backend=backend))
    for want, got in zip(eager, compiled, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # One graph before the FP8 layer (linear, gelu), one after it (tanh); traced in, the layer
    # would be an AutogradFunctionApply node of a single graph.
    assert len(graphs) == 2, graphs
    assert not any("AutogradFunctionApply" in graph for graph in graphs), graphs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("wgrad_fp8", [True, False], ids=["fp8-wgrad", "hp-wgrad"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_deferred_weight_gradient_equals_the_fused_backward(recipe, wgrad_fp8, device):
    """With a ``wgrad_sink`` the backward returns ``dx`` only and queues ``dw``/``db``; running
    the queue gives the bits of the fused backward's ``dw``/``db`` (same operands, same GEMM),
    over three micro-batches accumulated into ``.grad`` (plain and SwiGLU-fused forwards),
    and the delayed-scaling state ends the same. Every tensor a queued closure reaches is
    among the ones its ``holds`` names."""
    torch.manual_seed(0)
    m, k, n = 48, 128, 256  # smaller than the module's shapes: CPU tensorwise GEMMs are slow
    gemms = FP8_GEMMS if wgrad_fp8 else ("forward", "dgrad")
    layer = FP8Linear(k, n, recipe=recipe, fp8_gemms=gemms).to(device)
    twin = FP8Linear(k, n, recipe=recipe, fp8_gemms=gemms).to(device)
    twin.load_state_dict(layer.state_dict())
    sink = WeightGradSink()
    layer.wgrad_sink = sink
    unheld = watch_unheld(sink, layer.parameters())
    for micro_batch in range(3):
        x = (torch.randn(m, k) * (1 + micro_batch)).to(device)
        u = torch.randn(m, k).to(device)
        dy = torch.randn(m, n).to(device)
        x_deferred, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
        if micro_batch == 2:
            y, y_twin = layer.forward_swiglu(x_deferred, u), twin.forward_swiglu(x_fused, u)
        else:
            y, y_twin = layer(x_deferred), twin(x_fused)
        y.backward(dy)
        y_twin.backward(dy)
        assert torch.equal(y, y_twin) and torch.equal(x_deferred.grad, x_fused.grad)
        assert len(sink) == 1
        if micro_batch == 0:
            assert layer.weight.grad is None and layer.bias.grad is None
        sink.take()()
        assert len(sink) == 0
        assert torch.equal(layer.weight.grad, twin.weight.grad)
        assert torch.equal(layer.bias.grad, twin.bias.grad)
    assert torch.equal(layer.fp8_meta.health, twin.fp8_meta.health)
    if isinstance(recipe, DelayedScaling):
        assert torch.equal(layer.fp8_meta.amax_history, twin.fp8_meta.amax_history)
    assert unheld == [0, 0, 0]
    assert not layer.weight.grad.requires_grad  # no graph, as autograd's (grad mode was on)
