"""mt-convert for DeepSeek-V3 checkpoints stored as the Hub stores them: linear weights in
``float8_e4m3fn`` with a float32 ``<name>.weight_scale_inv`` per ``b0 × b1`` block and a
``quantization_config`` in ``config.json`` (hf_checkpoints.py's docstring).

The checkpoint is a tiny random transformers ``DeepseekV3ForCausalLM`` (the q-lora model of
test_train_convert_deepseek_v3.py with an MLP and expert widths that leave partial blocks)
whose linears are quantized as DeepSeek's are: per block ``s = amax / 448`` and
``q = e4m3(w / s)``, ``s`` stored as ``weight_scale_inv``. The quantized tensors are the ones
the Hub's index lists with a ``weight_scale_inv`` (every attention, dense-MLP, expert and
shared-expert linear); embeddings, norms, the router's ``gate.weight`` and
``e_score_correction_bias`` and ``lm_head`` stay unquantized. Block ``16 × 32`` is not square,
so swapped block sides show, and leaves partial blocks in both directions: rows 24 of
``q_a_proj``/``kv_a_proj_with_mqa`` (the Hub's ``kv_a_proj_with_mqa`` has 576 = 4.5 blocks),
columns 24 of ``q_b_proj``, 16 of ``kv_b_proj``, 80 of ``down_proj``, rows and columns 20 of
the experts. Weights and their scales sit in different shards, as some do on the Hub.

transformers itself is not the reference here: its FP8 loader needs ``accelerate``, which the
test extra does not install, and on a CPU it dequantizes with a block size derived from the
scale grid, which partial blocks break.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_train_convert_deepseek_v3 import _hf_config, _tokens
from train_checks import export_round_trip

from mt_train.checkpoint.files import CheckpointReader, checkpoint_folder
from mt_train.hf_checkpoints import full_model_tensors, import_hf, load_model, main
from mt_train.hf_shards import scale_float32

transformers = pytest.importorskip(
    "transformers", reason="the test extra: pip install 'mt-train[test]'"
)

BLOCK = (16, 32)
E4M3_MAX = 448.0
HUB_FP8 = re.compile(
    r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$"
)
"""The tensors DeepSeek-V3's Hub checkpoint stores in FP8 (its index's ``weight_scale_inv``)."""


def _block_index(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element's block row and column (an index independent of the code under test)."""
    return torch.arange(rows)[:, None] // BLOCK[0], torch.arange(cols)[None, :] // BLOCK[1]


def _quantize(w_OI: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's blockwise E4M3: ``s = amax / 448`` per block (partial ones at the ends);
    ``ue8m0``: ``s`` rounded up to a power of two (as DeepSeek's ``act_quant`` rounds under
    ``scale_fmt="ue8m0"``)."""
    rows, cols = w_OI.shape
    padded = F.pad(w_OI, (0, -cols % BLOCK[1], 0, -rows % BLOCK[0]))
    amax = padded.unflatten(0, (-1, BLOCK[0])).unflatten(-1, (-1, BLOCK[1])).abs().amax((1, 3))
    scale = amax / E4M3_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w_OI / scale[_block_index(rows, cols)]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def _dequantize_fp64(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double()[_block_index(*q.shape)]


def _shard(name: str) -> str:
    """Layers 0-1 in the first shard with their scales in the second, layer 2 the other way."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    first = layer is None or int(layer.group(1)) < 2
    if name.endswith("_scale_inv"):
        first = not first
    return f"model-0000{1 if first else 2}-of-00002.safetensors"


def _write(folder: Path, config: dict, tensors: dict[str, torch.Tensor], sharded: bool) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        files.setdefault(_shard(name) if sharded else "model.safetensors", {})[name] = tensor
    for file, part in files.items():
        save_file(part, str(folder / file), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def hub_fp8(tmp_path_factory: pytest.TempPathFactory):
    """(the FP8 checkpoint's config and tensors; the float64 dequantization of its FP8
    weights; a transformers model and plain float32 folder of those dequantized weights)."""
    torch.manual_seed(0)
    hf_config = _hf_config(24)
    hf_config.intermediate_size, hf_config.moe_intermediate_size = 80, 20
    model = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    with torch.no_grad():  # spread router scores (near-ties must not decide) and a real bias
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    root = tmp_path_factory.mktemp("hub_fp8")
    model.save_pretrained(root / "saved", safe_serialization=True)
    config = json.loads((root / "saved" / "config.json").read_text())
    original = load_file(str(root / "saved" / "model.safetensors"))
    fp8, exact = {}, {}
    for name, tensor in original.items():
        if HUB_FP8.search(name):
            fp8[name], fp8[f"{name}_scale_inv"] = _quantize(tensor)
            exact[name] = _dequantize_fp64(fp8[name], fp8[f"{name}_scale_inv"])
        else:
            fp8[name] = tensor
    assert len(exact) == 3 * 5 + 3 + 2 * (8 + 1) * 3  # attention ×3, dense MLP, experts + shared
    assert {n for n, t in original.items() if t.dim() == 2} - set(exact) == {
        "model.embed_tokens.weight", "lm_head.weight",
        "model.layers.1.mlp.gate.weight", "model.layers.2.mlp.gate.weight",
    }  # fmt: skip
    partial = {n for n in exact if any(d % b for d, b in zip(exact[n].shape, BLOCK, strict=True))}
    assert len(partial) == len(exact) - 3 - 2  # all but o_proj ×3 and the dense gate/up
    plain = {name: exact.get(name, tensor).float() for name, tensor in original.items()}
    plain_folder = _write(root / "dequantized", config, plain, sharded=False)
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(
        plain_folder, attn_implementation="eager"
    ).eval()
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(BLOCK)}  # fmt: skip
    return {**config, "quantization_config": quantization}, fp8, exact, reference, plain_folder


def _imported(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    return full_model_tensors(CheckpointReader(checkpoint_folder(import_hf(folder, out))))


def test_fp8_weights_import_as_their_exact_dequantization(hub_fp8, tmp_path: Path) -> None:
    """Every imported tensor equals, bit for bit, the import of a copy holding the float64
    dequantization rounded to float32: FP8 values convert to float32 exactly and a float32
    product is the exact one rounded once (4 + 24 significant bits, exact in float64)."""
    config, fp8, _, _, plain_folder = hub_fp8
    folder = _write(tmp_path / "fp8", config, fp8, sharded=True)
    got = _imported(folder, tmp_path / "mt")
    want = _imported(plain_folder, tmp_path / "plain")
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype == torch.float32, name
        assert torch.equal(tensor, want[name]), name


def test_fp8_import_matches_transformers_logits(hub_fp8, tmp_path: Path) -> None:
    config, fp8, _, reference, _ = hub_fp8
    folder = _write(tmp_path / "fp8", config, fp8, sharded=True)
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    ours = load_model(tmp_path / "mt").eval()
    with torch.no_grad():
        want = reference(_tokens()).logits
        got = ours(_tokens())
    # As test_train_convert_deepseek_v3.py: the same fp32 math in another op order, a few ulps
    # of logits of size ~1; a block height read off the scale grid where it divides the rows
    # (as transformers' CPU loader does: 12 rows for 24 in two blocks) moves them by 5.9e-2.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _hub_bf16(hub_fp8, tmp_path: Path) -> tuple[Path, Path]:
    """The Hub's layout: ``torch_dtype`` bfloat16, unquantized tensors in bf16 but the router
    bias in float32; the FP8 folder and an unquantized copy (the float64 dequantization
    rounded to bf16)."""
    config, fp8, exact, _, _ = hub_fp8
    config = {k: v for k, v in config.items() if k != "dtype"} | {"torch_dtype": "bfloat16"}
    hub = {
        name: t if t.dtype == torch.float8_e4m3fn or name.endswith(("_scale_inv", "_bias"))
        else t.bfloat16()
        for name, t in fp8.items()
    }  # fmt: skip
    folder = _write(tmp_path / "fp8", config, hub, sharded=True)
    plain = {n: exact[n].float().bfloat16() if n in exact else t for n, t in hub.items()}
    plain = {n: t for n, t in plain.items() if not n.endswith("_scale_inv")}
    plain_config = {k: v for k, v in config.items() if k != "quantization_config"}
    return folder, _write(tmp_path / "plain", plain_config, plain, sharded=False)


def test_bf16_checkpoint_stores_the_float32_product_in_bf16(hub_fp8, tmp_path: Path) -> None:
    """The Hub's bf16 layout (:func:`_hub_bf16`). A dequantized weight is the float32 product
    rounded to bf16, the value DeepSeek's ``fp8_cast_bf16.py`` writes (rounded twice, so it
    may sit one bf16 ulp from the float64 product rounded once)."""
    folder, plain_folder = _hub_bf16(hub_fp8, tmp_path)
    got = _imported(folder, tmp_path / "mt")
    want = _imported(plain_folder, tmp_path / "mt_plain")
    assert {t.dtype for t in got.values()} == {torch.bfloat16, torch.float32}
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype, name
        assert torch.equal(tensor, want[name]), name


def test_e8m0_bytes_convert_exactly_to_float32() -> None:
    """Every ``float8_e8m0fnu`` byte ``b`` reads as ``2^(b - 127)`` (``2^-127`` a float32
    subnormal), 0xFF as NaN; float32 scales pass unchanged."""
    codes = torch.arange(256, dtype=torch.uint8)
    got = scale_float32("s", codes.view(torch.float8_e8m0fnu), "ue8m0")
    want = torch.exp2(codes[:255].double() - 127).float()
    assert got.dtype == torch.float32 and torch.equal(got[:255], want) and got[255].isnan()
    assert want[0] == 2.0**-127 and want[0] != 0  # no flush to zero
    scale = torch.tensor([0.1, 3.0])
    assert scale_float32("s", scale, None) is scale


def test_ue8m0_scales_import_alike_in_float32_and_e8m0(hub_fp8, tmp_path: Path) -> None:
    """DeepSeek-V3.1's ``scale_fmt="ue8m0"``: power-of-two scales stored as float32 or as
    ``float8_e8m0fnu`` (with or without ``scale_fmt``) import bit for bit alike, and as a
    copy holding the float64 dequantization rounded to float32 (here exact: an E4M3 value
    times a power of two)."""
    config, _, exact, _, plain_folder = hub_fp8
    plain = load_file(str(plain_folder / "model.safetensors"))
    as_f32: dict[str, torch.Tensor] = {}
    for name, tensor in plain.items():
        if name in exact:
            as_f32[name], as_f32[f"{name}_scale_inv"] = _quantize(tensor, ue8m0=True)
        else:
            as_f32[name] = tensor
    as_e8m0 = {
        n: t.to(torch.float8_e8m0fnu) if n.endswith("_scale_inv") else t
        for n, t in as_f32.items()
    }  # fmt: skip
    for name, tensor in as_e8m0.items():
        if name.endswith("_scale_inv"):  # the e8m0 bytes hold the float32 scales exactly
            assert torch.equal(tensor.float(), as_f32[name]), name
            assert (torch.frexp(as_f32[name]).mantissa == 0.5).all(), name
    ue8m0 = {
        **config,
        "quantization_config": {**config["quantization_config"], "scale_fmt": "ue8m0"},
    }
    dequantized = {
        n: _dequantize_fp64(t, as_f32[f"{n}_scale_inv"]).float() if n in exact else t
        for n, t in as_f32.items()
        if not n.endswith("_scale_inv")
    }
    plain_config = {k: v for k, v in config.items() if k != "quantization_config"}
    folders = {
        "float32": _write(tmp_path / "float32", ue8m0, as_f32, sharded=True),
        "e8m0": _write(tmp_path / "e8m0", ue8m0, as_e8m0, sharded=True),
        "e8m0, no scale_fmt": _write(tmp_path / "e8m0_plain", config, as_e8m0, sharded=True),
    }
    want = _imported(_write(tmp_path / "plain", plain_config, dequantized, False), tmp_path / "p")
    for case, folder in folders.items():
        got = _imported(folder, tmp_path / f"{case} mt")
        assert got.keys() == want.keys(), case
        for name, tensor in got.items():
            assert tensor.dtype == want[name].dtype, (case, name)
            assert torch.equal(tensor, want[name]), (case, name)


def test_export_of_an_fp8_import_is_unquantized(hub_fp8, tmp_path: Path) -> None:
    config, fp8, _, reference, plain_folder = hub_fp8
    folder = _write(tmp_path / "fp8", config, fp8, sharded=True)
    assert main(["import", str(folder), str(tmp_path / "mt")]) == 0
    assert main(["export", str(tmp_path / "mt"), str(tmp_path / "back")]) == 0
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in exported and exported["torch_dtype"] == "float32"
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    plain = load_file(str(plain_folder / "model.safetensors"))
    assert back.keys() == plain.keys()
    assert all(torch.equal(tensor, plain[name]) for name, tensor in back.items())
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(_tokens()).logits, reference(_tokens()).logits)


def test_export_keeps_bf16_weights_beside_the_float32_router(hub_fp8, tmp_path: Path) -> None:
    """An imported bf16 DeepSeek-V3 (bf16 weights, float32 ``e_score_correction_bias``) exports
    as the Hub stores it, not upcast to float32: ``torch_dtype`` bfloat16, each tensor in its
    own dtype. transformers loads it as it loads the original (the bias stays float32, its
    ``_keep_in_fp32_modules_strict``): the same tensors and the same logits, bit for bit."""
    folder, plain_folder = _hub_bf16(hub_fp8, tmp_path)
    assert main(["import", str(folder), str(tmp_path / "fp8_mt")]) == 0
    assert main(["export", str(tmp_path / "fp8_mt"), str(tmp_path / "fp8_back")]) == 0
    exported = json.loads((tmp_path / "fp8_back" / "config.json").read_text())
    assert exported["torch_dtype"] == exported["dtype"] == "bfloat16"
    back = export_round_trip(plain_folder, tmp_path)  # every tensor, dtype included
    assert json.loads((back / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = load_file(str(back / "model.safetensors"))
    assert {n for n, t in tensors.items() if t.dtype != torch.bfloat16} == {
        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)
    }
    for name, tensor in load_file(str(tmp_path / "fp8_back" / "model.safetensors")).items():
        assert tensor.dtype == tensors[name].dtype, name
    # Eager experts: bf16 grouped GEMMs on a CPU want 16-byte strides (the widths are 20).
    kwargs = {"attn_implementation": "eager", "experts_implementation": "eager"}
    want = transformers.DeepseekV3ForCausalLM.from_pretrained(plain_folder, **kwargs).eval()
    got = transformers.DeepseekV3ForCausalLM.from_pretrained(back, **kwargs).eval()
    state = got.state_dict()
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert all(torch.equal(t, state[n]) and t.dtype == state[n].dtype
               for n, t in want.state_dict().items())  # fmt: skip
    with torch.no_grad():
        assert torch.equal(got(_tokens()).logits, want(_tokens()).logits)


def test_fp8_checkpoints_mt_cannot_read_are_refused_with_one_line(hub_fp8, tmp_path, capsys):
    config, fp8, _, _, _ = hub_fp8
    weight = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    scale = f"{weight}_scale_inv"
    pair = {weight: fp8[weight], scale: fp8[scale]}  # [24, 64] and [2, 2]
    quant = config["quantization_config"]
    plain_config = {k: v for k, v in config.items() if k != "quantization_config"}
    cases = {
        "quant_method": (
            {**config, "quantization_config": {**quant, "quant_method": "bitsandbytes"}}, pair,
            "quantization_config.quant_method='bitsandbytes' is not supported; valid: 'fp8'",
        ),
        "fmt": (
            {**config, "quantization_config": {**quant, "fmt": "e5m2"}}, pair,
            "quantization_config.fmt='e5m2' is not supported; valid: 'e4m3'",
        ),
        "scale_fmt": (
            {**config, "quantization_config": {**quant, "scale_fmt": "fp32"}}, pair,
            "quantization_config.scale_fmt='fp32' is not supported; valid: 'ue8m0' "
            "(power-of-two scales, DeepSeek-V3.1's) or none (float32 scales)",
        ),
        "not a power of two": (
            {**config, "quantization_config": {**quant, "scale_fmt": "ue8m0"}}, pair,
            f"{scale} holds {fp8[scale][0, 0].item()!r} at block [0, 0], not a power of two, "
            "but quantization_config.scale_fmt='ue8m0'",
        ),
        "block": (
            {**config, "quantization_config": {**quant, "weight_block_size": [128]}}, pair,
            "quantization_config.weight_block_size=[128] is not supported; valid: two positive",
        ),
        "dtype": (
            {**config, "dtype": "float8_e4m3fn"}, pair,
            "dtype='float8_e4m3fn' of an FP8 checkpoint is not supported; valid: "
            "float32, bfloat16, float16",
        ),
        "no scale": (
            config, {weight: fp8[weight]},
            f"{weight} is float8_e4m3fn without its {scale} (valid: a scale per weight block, "
            "float32 or float8_e8m0fnu)",
        ),
        "scale shape": (
            config, {**pair, scale: torch.ones(3, 2)},
            f"{scale} has shape [3, 2]; valid for weight shape [24, 64] and weight_block_size="
            "[16, 32]: [2, 2]",
        ),
        "scale dtype": (
            config, {**pair, scale: fp8[scale].bfloat16()},
            f"{scale} is torch.bfloat16; valid: torch.float32 or torch.float8_e8m0fnu",
        ),
        "no weight": (
            config, {scale: fp8[scale]},
            f"{scale} has no {weight} in the checkpoint (valid: a scale next to the float8_e4m3fn",
        ),
        "unquantized weight": (
            config, {**pair, weight: fp8[weight].float()},
            f"{scale} scales {weight}, which is torch.float32; valid: a scale only next to a",
        ),
        "e5m2 weight": (
            config, {**pair, weight: fp8[weight].float().to(torch.float8_e5m2)},
            f"{weight} is torch.float8_e5m2; valid FP8 weights: torch.float8_e4m3fn",
        ),
        "no quantization_config": (
            plain_config, {weight: fp8[weight]},
            f"{weight} is torch.float8_e4m3fn but config.json has no quantization_config",
        ),
    }  # fmt: skip
    for case, (case_config, tensors, line) in cases.items():
        folder = _write(tmp_path / case, case_config, tensors, sharded=True)
        with pytest.raises(ValueError, match=re.escape(line)):
            import_hf(folder, tmp_path / f"{case} mt")
    assert torch.frexp(fp8[scale]).mantissa[0, 0] != 0.5  # amax / 448: not a power of two
    for case, line in [("no scale", f"{weight} is float8_e4m3fn without its"),
                       ("not a power of two", f"{scale} holds ")]:  # fmt: skip
        folder = tmp_path / case
        assert main(["import", str(folder), str(tmp_path / f"{case} cli")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and line in err
        assert not (tmp_path / f"{case} cli").exists()
