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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
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
    SCALE_SUFFIX,
    FP8Weights,
    HFShards,
    dequantize_fp8,
    fp8_weights,
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
"""Import writes a file of the checkpoint each time it has this many bytes (Hugging Face's
default ``max_shard_size`` of 5 GB): the bound on what it buffers."""


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
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            if not args.max_file_gb > 0:
                raise ValueError(f"--max-file-gb={args.max_file_gb}; valid: a positive size")
            max_bytes = max(1, round(args.max_file_gb * 1e9))
            written = import_hf(args.hf_dir, args.out, args.mtp_depth, max_file_bytes=max_bytes)
        else:
            written = export_hf(args.checkpoint, args.out, args.mtp_depth)
    except (OSError, ValueError, KeyError, UserError) as err:
        return report("mt-convert", err.args[0] if isinstance(err, KeyError) and err.args else err)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
