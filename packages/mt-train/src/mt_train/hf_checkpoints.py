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
Llama), writes each tensor in the checkpoint's dtype and labels ``config.json``'s
``torch_dtype`` with it. A checkpoint of mixed dtypes is written so that transformers'
``from_pretrained`` (``dtype="auto"``: the model built in ``torch_dtype``, each tensor cast
to its parameter's dtype) loads it without loss (:func:`export_dtypes`): where all tensors
but float32 ones the HF model keeps in float32 (the adapter's ``float32_names``:
DeepSeek-V3's router weight and ``e_score_correction_bias``) share one dtype, every tensor
keeps its own and ``torch_dtype`` names the shared one (an imported DeepSeek-V3: bf16
weights and float32 biases, as the Hub's bf16 checkpoint, 1.3 TB rather than 2.7 TB of
float32); any other mix is upcast to float32, losslessly (labelled with the majority dtype,
its float32 tensors would be rounded by ``from_pretrained``).

Streaming. ``mt-convert import`` never holds the whole model: :class:`~mt_train.hf_shards.HFShards`
indexes the folder's shards from their headers (a name -> shard map; FP8 weights and their
scales are checked there, before anything is read), the family's adapter splits the tensor
names into groups (:meth:`~mt_train.models.HFAdapter.import_groups`: the built-in families
by decoder layer, routed experts by projection), and each group is read, converted by
``tensors_from_hf`` and handed to a :class:`~mt_train.checkpoint.files.ShardWriter`, which
writes a file of the checkpoint each time it has buffered ``max_file_bytes`` (``--max-file-gb``,
default 5). Host memory holds one group as read and converted plus that buffer: for
DeepSeek-V3 671B in bf16, a 7.5 GB projection of a layer's 256 experts twice (the experts
and their stack) and at most 5 GB buffered, where the whole import is 1.3 TB. A model below
the limit is written as one file, byte for byte what converting it whole writes; above, as
``rank-00000-part-<k>.safetensors`` files, which the manifest lists as it lists ranks (format
unchanged; :mod:`mt_train.checkpoint.files`). A family whose adapter does not override
``import_groups`` (a third-party one whose conversion needs the whole model) is converted
in one group, the whole model in memory, as before. Tensor names are checked per group (one
the config does not have stops the import at once) and the missing ones at the end; an
import that fails leaves no ``.tmp-step-*`` folder behind.

Export streams the same way, the other direction. The checkpoint's model keys (tp=1 names)
go through the adapter's ``export_view`` (which MTP modules) and ``export_groups`` (the
built-in families: embedding, final norm and head, then each layer, a layer's stacked routed
experts by projection; :func:`~mt_train.models.family.layer_groups` of mt names). A first
pass converts every group as meta tensors read from the files' headers
(:class:`HeaderReader`: TP slices and FSDP2 pieces re-joined as on load, no data read); it
gives every name, shape and dtype export writes, so the dtype (above), the ``config.json``
(whose refusals come first) and the files (:func:`~mt_train.hf_shards.plan_files`: at most
``--max-file-gb`` each, default 5, ``save_pretrained``'s ``max_shard_size``) are fixed
before a tensor is read or a file written. The second pass reads each group (``safe_open``
reads single tensors), converts it with ``tensors_to_hf`` and hands it to a
:class:`~mt_train.hf_shards.HFWriter`, which writes each file as soon as its last tensor
arrives and publishes the folder at the end (a failed or killed export leaves the previous
export or the new one once the next export or import has restored it, never a mix of files
and never a folder without either). Host memory holds one group as read and converted plus the file
being filled: for V3 in bf16 a 7.5 GB expert projection and 5 GB (a projection's stack stays
alive while any of its experts waits for its file; three times the projection when a
checkpoint of mixed dtypes is upcast to float32), where the whole model is 1.3 TB. Below
the limit the folder holds one ``model.safetensors``, byte for byte what converting the
whole model at once writes; above it ``model-<k>-of-<n>.safetensors`` files and
``model.safetensors.index.json``. An adapter without ``export_groups`` converts the whole
model in one group, as before.

:func:`load_model` builds the model and fills it one tensor at a time (``load_state_dict`` of
one key, so module load hooks such as mt_fp8's still run): host memory holds the model and
one tensor, not the model twice.

FP8 weights (DeepSeek-V3's Hub layout) are dequantized as they are read; the layout, the
math and every refusal are in :mod:`mt_train.hf_shards`. Export writes no FP8 and no
``quantization_config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from torch import nn

from mt_train.checkpoint.checkpointer import TPLayout, read_resharded
from mt_train.checkpoint.files import (
    CheckpointReader,
    ShardWriter,
    checkpoint_folder,
    publish,
    tmp_dir,
)
from mt_train.config.schema import ModelConfig
from mt_train.errors import UserError, report
from mt_train.hf_shards import (  # noqa: F401 (re-exported: the FP8 layout's names)
    SAFETENSORS_DTYPES,
    SCALE_SUFFIX,
    FP8Weights,
    HFShards,
    HFWriter,
    dequantize_fp8,
    fp8_weights,
    plan_files,
    restore_interrupted_export,
)
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


DEFAULT_MAX_FILE_BYTES = 5 * 10**9
"""Import writes a file of the checkpoint each time it has this many bytes, export writes
files of at most this many (Hugging Face's default ``max_shard_size`` of 5 GB): the bound on
what they buffer."""


def import_manifest(cfg: ModelConfig, family: ModelFamily, hf_dir: Path) -> dict[str, Any]:
    """The manifest of an imported checkpoint (model tensors only, step 0, one rank)."""
    return {
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


def _convert_group(
    shards: HFShards,
    group: list[str],
    adapter: HFAdapter,
    hf_cfg: dict[str, Any],
    expected: set[str],
    writer: ShardWriter,
) -> None:
    """Read, convert and write one of the adapter's groups (its tensors die on return)."""
    state = adapter.tensors_from_hf({name: shards.get(name) for name in group}, hf_cfg)
    tensors = {f"model/{k}": v for k, v in state.items()}
    extra = sorted(set(tensors) - expected)
    if extra:
        raise ValueError(
            f"tensor names do not match the config: extra {extra[:3]} (from {group[:3]})"
        )
    writer.add(tensors)


def import_hf(
    hf_dir: str | Path,
    out_root: str | Path,
    mtp_depth: int | None = None,
    log: Callable[[str], None] = print,
    max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES,
) -> Path:
    """Write ``<out_root>/step-00000000`` from a Hugging Face model folder; returns it.
    ``mtp_depth``: how many of the checkpoint's multi-token-prediction layers to import (None:
    all it holds; 0: none); what is skipped is told through ``log`` in one line.
    ``max_file_bytes``: the size at which the checkpoint is split into files (None: one
    file, the whole model in memory; module docstring)."""
    hf_dir, out_root = Path(hf_dir), Path(out_root)
    if hf_dir.is_dir():  # a folder a killed mt-convert export left: one whole export again
        restore_interrupted_export(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(hf_dir)!r} has no config.json")
    hf_cfg = json.loads(config_path.read_text())
    family, adapter = family_for_architectures(hf_cfg)
    with HFShards(hf_dir, fp8_weights(hf_cfg)) as shards:
        hf_cfg, note = adapter.import_view(hf_cfg, set(shards.names), mtp_depth)
        if note is not None:
            log(note)
        cfg = adapter.config_from_hf(hf_cfg, hf_dir.name)
        expected = {f"model/{k}" for k in build_model(cfg, "meta").state_dict()}
        groups = adapter.import_groups(shards.names, hf_cfg)
        run_id = uuid.uuid4().hex
        folder = tmp_dir(out_root, 0)
        created = not out_root.exists()
        try:
            writer = ShardWriter(folder, 0, run_id, max_file_bytes)
            for group in groups:
                _convert_group(shards, group, adapter, hf_cfg, expected, writer)
            missing = sorted(expected - writer.names)
            if missing:
                raise ValueError(f"tensor names do not match the config: missing {missing[:3]}")
            writer.close()
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            if created:
                shutil.rmtree(out_root, ignore_errors=True)
            raise
    return publish(out_root, 0, 1, run_id, import_manifest(cfg, family, hf_dir), keep_last=1)


def model_config_of(reader: CheckpointReader) -> ModelConfig:
    """The model config a checkpoint's manifest records, as its family's dataclass."""
    manifest = reader.manifest
    raw = dict(manifest.get("model") or manifest["config"]["model"])
    family = get_family(manifest.get("model_family", DEFAULT_FAMILY))
    typed = OmegaConf.merge(OmegaConf.structured(family.config), raw)
    return OmegaConf.to_object(typed)  # type: ignore[return-value]


def model_keys(reader: CheckpointReader) -> list[str]:
    """The checkpoint's model state-dict keys (tp=1 names: no ``model/`` prefix, no TP-slice
    or FSDP2-piece suffix), sorted."""
    names = {n.removeprefix("model/").split("@")[0] for n in reader.names("model/")}
    # Checkpoints of FP8 runs written before 2026-12-07 also saved each FP8 layer's shared
    # weight again under ``<layer>._fp8.``; the layer's own entry holds the same tensor.
    return sorted(n for n in names if "._fp8." not in n)


def model_tensors(reader: CheckpointReader, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The model tensors ``keys`` at tp=1 (TP slices and FSDP2 pieces re-joined)."""
    plan = reader.manifest.get("tp_plan", {})
    single = TPLayout(plan, 0, 1)
    return {k: read_resharded(reader, f"model/{k}", plan.get(k), single) for k in keys}


def full_model_tensors(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Every model tensor at tp=1, all in memory at once (to compare checkpoints)."""
    return model_tensors(reader, model_keys(reader))


def load_model(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """An mt checkpoint (folder or root) as its family's plain tp=1 model, its tensors read
    one at a time (module docstring)."""
    reader = CheckpointReader(checkpoint_folder(Path(path)))
    model = build_model(model_config_of(reader), device)
    keys, live = model_keys(reader), model.state_dict()
    missing, extra = sorted(set(live) - set(keys)), sorted(set(keys) - set(live))
    if missing or extra:
        raise ValueError(
            f"checkpoint {reader.folder} does not match its model config: missing "
            f"{missing[:3]}, unexpected {extra[:3]}"
        )
    for key in keys:
        _load_tensor(model, key, model_tensors(reader, [key])[key], live[key].shape)
    return model


def _load_tensor(model: nn.Module, key: str, tensor: torch.Tensor, shape: torch.Size) -> None:
    """Copy ``tensor`` into the model's ``key`` (it dies on return, before the next is read)."""
    if tensor.shape != shape:
        raise ValueError(
            f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, the model "
            f"{tuple(shape)}: is the manifest's model config the one it saved?"
        )
    # Through the owning module's load_state_dict (its load hooks run, mt_fp8's too), not
    # the whole model's, which would visit every module once per tensor.
    owner, _, leaf = key.rpartition(".")
    result = model.get_submodule(owner).load_state_dict({leaf: tensor}, strict=False)
    # strict=False because the owner's other tensors come in their own calls; a name the owner
    # does not take (a state dict not laid out as the module tree) must not pass silently.
    if result.unexpected_keys:
        raise ValueError(
            f"checkpoint tensor {key}: module {owner or '<root>'!r} takes no {leaf!r} in "
            f"load_state_dict, so it cannot be loaded tensor by tensor"
        )


class HeaderReader(CheckpointReader):
    """A checkpoint whose tensors read as meta tensors of their stored dtype and shape, from
    the files' headers (no data read, no sha256 checked): what export plans with."""

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            if name not in self.manifest["tensors"]:
                raise KeyError(f"checkpoint {self.folder} has no tensor {name!r}")
            path = self.folder / self.manifest["tensors"][name]
            with safe_open(str(path), framework="pt") as f:
                view = f.get_slice(name)
                dtype = SAFETENSORS_DTYPES[view.get_dtype()]
                out[name] = torch.empty(view.get_shape(), dtype=dtype, device="meta")
        return out


def export_dtypes(
    dtypes: dict[str, torch.dtype], float32_names: tuple[str, ...] = ()
) -> tuple[torch.dtype, dict[str, torch.dtype]]:
    """The ``torch_dtype`` export writes in ``config.json`` and the dtype it writes each tensor
    in, given the converted tensors' dtypes by HF name (module docstring): one dtype for all
    tensors but the float32 ones named by ``float32_names`` (kept float32, as the HF model
    holds them): that dtype, each tensor in its own; any other mix: float32 for all."""
    kept = {n for n, d in dtypes.items() if d == torch.float32 and n.endswith(float32_names)}
    others = {d for n, d in dtypes.items() if n not in kept}
    if len(others) <= 1:
        return (others.pop() if others else torch.float32), dict(dtypes)
    return torch.float32, dict.fromkeys(dtypes, torch.float32)


def export_hf(
    path: str | Path,
    out_dir: str | Path,
    mtp_depth: int | None = None,
    max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES,
) -> Path:
    """Write a Hugging Face folder (``config.json`` and the weights, in files of at most
    ``max_file_bytes``; None: one file) from an mt checkpoint, with its first ``mtp_depth``
    multi-token-prediction modules (None: all it has; 0: none); module docstring."""
    folder = checkpoint_folder(Path(path))
    reader = CheckpointReader(folder)
    cfg = model_config_of(reader)
    family = family_of(cfg)
    adapter = family.hf
    if adapter is None:
        raise ValueError(f"model family {family.name!r} has no Hugging Face adapter")
    cfg, keys = adapter.export_view(cfg, model_keys(reader), mtp_depth)
    groups = adapter.export_groups(keys, cfg)
    header = HeaderReader(folder)
    planned = [adapter.tensors_to_hf(model_tensors(header, group), cfg) for group in groups]
    twice = sorted(n for n, c in Counter(n for hf in planned for n in hf).items() if c > 1)
    if twice:
        raise ValueError(f"the adapter's export groups convert {twice[:3]} more than once")
    dtype, written = export_dtypes(
        {n: t.dtype for hf in planned for n, t in hf.items()}, adapter.float32_names
    )
    config = adapter.config_to_hf(cfg, dtype)
    sizes = ((n, t.numel() * written[n].itemsize) for hf in planned for n, t in hf.items())
    writer = HFWriter(Path(out_dir), plan_files(sizes, max_file_bytes))
    try:
        for group in groups:
            tensors = adapter.tensors_to_hf(model_tensors(reader, group), cfg)
            writer.add({k: v.to(written[k]) for k, v in tensors.items()})
            del tensors  # before the next group is read: host memory holds one group
        writer.close(config)
    except BaseException:
        writer.discard()
        raise
    return Path(out_dir)


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
    imp.add_argument(
        "--max-file-gb",
        type=float,
        default=DEFAULT_MAX_FILE_BYTES / 1e9,
        help="write the checkpoint in files of about this many GB (what import buffers; "
        "default: %(default)s)",
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
    exp.add_argument(
        "--max-file-gb",
        type=float,
        default=DEFAULT_MAX_FILE_BYTES / 1e9,
        help="write the weights in files of at most this many GB, with an index past one "
        "(Hugging Face's max_shard_size; default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        if not args.max_file_gb > 0:
            raise ValueError(f"--max-file-gb={args.max_file_gb}; valid: a positive size")
        max_bytes = max(1, round(args.max_file_gb * 1e9))
        if args.command == "import":
            written = import_hf(args.hf_dir, args.out, args.mtp_depth, max_file_bytes=max_bytes)
        else:
            written = export_hf(args.checkpoint, args.out, args.mtp_depth, max_bytes)
    except (OSError, ValueError, KeyError, UserError) as err:
        return report("mt-convert", err.args[0] if isinstance(err, KeyError) and err.args else err)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
