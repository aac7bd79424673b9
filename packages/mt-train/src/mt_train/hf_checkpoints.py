"""``mt-convert``: Hugging Face checkpoints (config.json + safetensors) ⇄ mt checkpoints.

Import reads ``config.json``'s ``architectures`` and hands the folder to the registered model
family whose Hugging Face adapter (:class:`mt_train.models.HFAdapter`) reads that architecture
(``LlamaForCausalLM``: :mod:`mt_train.models.llama.hf`; ``MixtralForCausalLM``:
:mod:`mt_train.models.moe.hf`; each documents its name map and the config fields it refuses).
It writes an mt checkpoint root holding ``step-00000000`` (model tensors only; manifest
``model`` = the family's config, ``model_family`` = its name), which
``checkpoint.init_from=<root>`` trains from. ``import --mtp-depth D`` imports the first ``D``
multi-token-prediction layers of a checkpoint that has them (default: all; the adapter's
``import_view`` decides and refuses the rest); ``export --mtp-depth D`` writes the first
``D`` of the model's (``export_view``; 0 for plain next-token inference). Export goes back
through the family named in the manifest (checkpoints from before manifests named one are
Llama) and labels ``config.json``'s ``torch_dtype`` with the dtype of the tensors it writes:
the checkpoint's, or float32 when a checkpoint mixes dtypes (every weight then upcast,
losslessly).

FP8 weights (transformers' fine-grained FP8 layout, DeepSeek-V3's Hub checkpoints). A
``config.json`` with ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [b0, b1], ...}`` stores some ``<name>.weight`` tensors as
``float8_e4m3fn`` ``w_OI`` next to a float32 ``<name>.weight_scale_inv`` ``s`` of shape
``[ceil(O/b0), ceil(I/b1)]`` (the last block row and column may be partial); import reads
them as::

    w[i, j] = float32(w_OI[i, j]) · s[i // b0, j // b1]

the float32 product DeepSeek's ``weight_dequant`` computes (the FP8 value converts exactly, so
it is the exact product rounded once to float32), stored in the checkpoint's ``torch_dtype``
(``dtype``; float32 when it names none), the dtype its unquantized tensors have and an
unquantized copy would store the weight in. Each weight is dequantized as it is read (the
small scales are read first, from whichever shard holds them), so no FP8 copy of the model is
held beside the dequantized one. The scales are consumed (the family's adapter never sees
them). ``activation_scheme`` is not read: it says how inference quantizes activations.
Refused with one line each: another ``quant_method`` or ``fmt``, a ``weight_block_size`` that
is not two positive integers, a ``torch_dtype`` other than float32/bfloat16/float16, a float8
tensor without a ``quantization_config``, of another float8 dtype, of fewer than two
dimensions or without its scale, a scale that is not float32, whose shape is not
``[ceil(O/b0), ceil(I/b1)]`` or whose weight is missing or not float8. Export writes no FP8
and no ``quantization_config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from mt_train.checkpoint.checkpointer import TPLayout, read_resharded
from mt_train.checkpoint.files import (
    CheckpointReader,
    checkpoint_folder,
    publish,
    tmp_dir,
    write_shard,
)
from mt_train.config.schema import ModelConfig
from mt_train.errors import CheckpointError, UserError, report
from mt_train.models.build import build_model
from mt_train.models.family import HFAdapter, ModelFamily
from mt_train.models.registry import DEFAULT_FAMILY, family_of, get_family, model_families


def family_for_architectures(hf: dict[str, Any]) -> tuple[ModelFamily, HFAdapter]:
    """The registered family whose adapter reads ``config.json``'s ``architectures`` (or, in a
    config saved without them, its ``model_type``)."""
    adapters = [(f, f.hf) for f in model_families().values() if f.hf is not None]
    wanted = list(hf.get("architectures") or [])
    for family, adapter in adapters:
        if set(wanted) & set(adapter.architectures) or (
            not wanted and hf.get("model_type") in adapter.model_types
        ):
            return family, adapter
    readable = sorted(arch for _, adapter in adapters for arch in adapter.architectures)
    raise ValueError(
        f"architectures={wanted} (model_type={hf.get('model_type')!r}) has no registered model "
        f"family; readable: {', '.join(readable) or '(none)'}"
    )


SCALE_SUFFIX = "_scale_inv"
"""``<weight name>`` + this names an FP8 weight's block scales (module docstring)."""
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class FP8Weights:
    """How a checkpoint's FP8 weights are read (module docstring)."""

    block: tuple[int, int]
    """``weight_block_size``: rows × columns of a weight that share one scale."""
    dtype: torch.dtype
    """What a dequantized weight is stored in (the checkpoint's ``torch_dtype``)."""


def fp8_weights(hf: dict[str, Any]) -> FP8Weights | None:
    """The FP8 layout ``config.json``'s ``quantization_config`` declares (None: none);
    refuses every other quantization with one line."""
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported; valid: 'fp8' "
            "(block-scaled float8_e4m3fn weights, as DeepSeek-V3's), or an unquantized copy"
        )
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported; valid: 'e4m3'")
    # activation_scheme is not read: it says how inference quantizes activations, which
    # training from these weights does not reuse (mt's fp8 recipes pick their own scales).
    block = quant.get("weight_block_size")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"quantization_config.weight_block_size={block!r} is not supported; valid: two "
            "positive integers [rows, columns] (DeepSeek-V3: [128, 128])"
        )
    key = "dtype" if hf.get("dtype") else "torch_dtype"  # transformers 5 writes dtype
    name = hf.get(key) or "float32"
    if name not in _FLOAT_DTYPES:
        raise ValueError(
            f"{key}={name!r} of an FP8 checkpoint is not supported; valid: "
            f"{', '.join(_FLOAT_DTYPES)} (what its FP8 weights are dequantized to)"
        )
    return FP8Weights((block[0], block[1]), _FLOAT_DTYPES[name])


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``float32(weight[..., i, j]) · scale_inv[..., i // b0, j // b1]`` in float32."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.to(torch.float32).mul_(scale)


def _is_float8(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1


def _fp8_checked(
    name: str, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]
) -> None:
    """Refuse an FP8 weight and its scale that do not make the module docstring's pair."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{name} is {weight.dtype}; valid FP8 weights: torch.float8_e4m3fn "
            "(quantization_config.fmt='e4m3')"
        )
    if scale is None:
        raise ValueError(
            f"{name} is float8_e4m3fn without its {name}{SCALE_SUFFIX} (valid: a float32 "
            "scale per weight block)"
        )
    if scale.dtype != torch.float32:
        raise ValueError(f"{name}{SCALE_SUFFIX} is {scale.dtype}; valid: torch.float32")
    if weight.dim() < 2:
        raise ValueError(f"{name} is an FP8 tensor of shape {list(weight.shape)}; valid: 2-D")
    *lead, rows, cols = weight.shape
    want = [*lead, -(-rows // block[0]), -(-cols // block[1])]
    if list(scale.shape) != want:
        raise ValueError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale.shape)}; valid for weight shape "
            f"{list(weight.shape)} and weight_block_size={list(block)}: {want}"
        )


def _safetensors_items(
    path: Path, keep: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the tensors in ``path`` whose names ``keep`` accepts."""
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if keep(key):
                    yield key, f.get_tensor(key)
    except SafetensorError as err:
        raise CheckpointError(f"{str(path)!r} is not a readable safetensors file: {err}") from None


def _read_hf_tensors(folder: Path, fp8: FP8Weights | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's shards by name, FP8 weights dequantized (``fp8``: the
    checkpoint's :func:`fp8_weights`; module docstring)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(folder)!r}")
    scales: dict[str, torch.Tensor] = {}
    if fp8 is not None:  # a weight's scale may sit in another shard: read them all first
        for path in files:
            scales.update(_safetensors_items(path, lambda key: key.endswith(SCALE_SUFFIX)))
    out: dict[str, torch.Tensor] = {}
    for path in files:
        for key, tensor in _safetensors_items(
            path, lambda k: not (fp8 and k.endswith(SCALE_SUFFIX))
        ):
            scale = scales.pop(key + SCALE_SUFFIX, None)
            if _is_float8(tensor):
                if fp8 is None:
                    raise ValueError(
                        f"{key} is {tensor.dtype} but config.json has no quantization_config "
                        "(valid: quant_method 'fp8' with a weight_block_size, or no float8 "
                        "tensors)"
                    )
                _fp8_checked(key, tensor, scale, fp8.block)
                tensor = dequantize_fp8(tensor, scale, fp8.block).to(fp8.dtype)
            elif scale is not None:
                raise ValueError(
                    f"{key}{SCALE_SUFFIX} scales {key}, which is {tensor.dtype}; valid: a "
                    "scale only next to a float8_e4m3fn weight"
                )
            out[key] = tensor
    if scales:
        name = min(scales)
        raise ValueError(
            f"{name} has no {name.removesuffix(SCALE_SUFFIX)} in the checkpoint (valid: a "
            "scale next to the float8_e4m3fn weight it is named after)"
        )
    return out


def import_hf(
    hf_dir: str | Path,
    out_root: str | Path,
    mtp_depth: int | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Write ``<out_root>/step-00000000`` from a Hugging Face model folder; returns it.
    ``mtp_depth``: how many of the checkpoint's multi-token-prediction layers to import (None:
    all it holds; 0: none); what is skipped is told through ``log`` in one line."""
    hf_dir, out_root = Path(hf_dir), Path(out_root)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(hf_dir)!r} has no config.json")
    hf_cfg = json.loads(config_path.read_text())
    family, adapter = family_for_architectures(hf_cfg)
    hf_tensors = _read_hf_tensors(hf_dir, fp8_weights(hf_cfg))
    hf_cfg, note = adapter.import_view(hf_cfg, set(hf_tensors), mtp_depth)
    if note is not None:
        log(note)
    cfg = adapter.config_from_hf(hf_cfg, hf_dir.name)
    state = adapter.tensors_from_hf(hf_tensors, hf_cfg)
    tensors = {f"model/{k}": v for k, v in state.items()}
    expected = {f"model/{k}" for k in build_model(cfg, "meta").state_dict()}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(
            f"tensor names do not match the config: missing {missing[:3]}, extra {extra[:3]}"
        )
    run_id = uuid.uuid4().hex
    write_shard(tmp_dir(out_root, 0), 0, run_id, tensors)
    manifest = {
        "step": 0,
        "config": {"model": dataclasses.asdict(cfg)},
        "model": dataclasses.asdict(cfg),
        "model_family": family.name,
        "data": None,
        "world_size": 1,
        "parallel": {"tp": 1, "dp": 1},
        "tp_plan": {},
        "source": {"huggingface": str(hf_dir)},
    }
    return publish(out_root, 0, 1, run_id, manifest, keep_last=1)


def model_config_of(reader: CheckpointReader) -> ModelConfig:
    """The model config a checkpoint's manifest records, as its family's dataclass."""
    manifest = reader.manifest
    raw = dict(manifest.get("model") or manifest["config"]["model"])
    family = get_family(manifest.get("model_family", DEFAULT_FAMILY))
    typed = OmegaConf.merge(OmegaConf.structured(family.config), raw)
    return OmegaConf.to_object(typed)  # type: ignore[return-value]


def full_model_tensors(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Every model tensor at tp=1 (TP slices and FSDP2 pieces re-joined)."""
    plan = reader.manifest.get("tp_plan", {})
    keys = {n.removeprefix("model/").split("@")[0] for n in reader.names("model/")}
    single = TPLayout(plan, 0, 1)
    return {k: read_resharded(reader, f"model/{k}", plan.get(k), single) for k in sorted(keys)}


def load_model(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """An mt checkpoint (folder or root) as its family's plain tp=1 model."""
    reader = CheckpointReader(checkpoint_folder(Path(path)))
    model = build_model(model_config_of(reader), device)
    model.load_state_dict(full_model_tensors(reader))
    return model


def export_hf(path: str | Path, out_dir: str | Path, mtp_depth: int | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (HF names) from an mt checkpoint, with its
    first ``mtp_depth`` multi-token-prediction modules (None: all it has; 0: none)."""
    reader = CheckpointReader(checkpoint_folder(Path(path)))
    cfg = model_config_of(reader)
    family = family_of(cfg)
    if family.hf is None:
        raise ValueError(f"model family {family.name!r} has no Hugging Face adapter")
    cfg, state = family.hf.export_view(cfg, full_model_tensors(reader), mtp_depth)
    tensors = family.hf.tensors_to_hf(state)
    dtypes = {t.dtype for t in tensors.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = family.hf.config_to_hf(cfg, dtype)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mt-convert",
        description="Convert checkpoints between Hugging Face and mt (any registered family).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face folder -> mt checkpoint root")
    imp.add_argument("hf_dir", type=Path)
    imp.add_argument("out", type=Path)
    imp.add_argument(
        "--mtp-depth",
        type=int,
        default=None,
        help="multi-token-prediction layers to import (default: all the checkpoint holds)",
    )
    exp = sub.add_parser("export", help="mt checkpoint (folder or root) -> Hugging Face folder")
    exp.add_argument("checkpoint", type=Path)
    exp.add_argument("out", type=Path)
    exp.add_argument(
        "--mtp-depth",
        type=int,
        default=None,
        help="multi-token-prediction modules to write (default: all; 0 for next-token inference)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            written = import_hf(args.hf_dir, args.out, args.mtp_depth)
        else:
            written = export_hf(args.checkpoint, args.out, args.mtp_depth)
    except (OSError, ValueError, KeyError, UserError) as err:
        return report("mt-convert", err.args[0] if isinstance(err, KeyError) and err.args else err)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
