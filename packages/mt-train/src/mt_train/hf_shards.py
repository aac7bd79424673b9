"""A Hugging Face folder's safetensors shards, read one tensor at a time (``mt-convert import``)
and written as their tensors arrive (``mt-convert export``, :class:`HFWriter`).

:class:`HFShards` opens every ``*.safetensors`` file of the folder once and indexes its tensors
by name from the headers alone (dtype, shape and file; no tensor data is read), so a checkpoint
of any size costs a few kilobytes per shard until :meth:`HFShards.get` reads a tensor. Each
``get`` returns a tensor of its own (safetensors copies it out of the file), which the caller
drops when done: host memory holds what the caller keeps alive, nothing more. A name held by
two shards is refused (Hugging Face's ``model.safetensors.index.json`` maps each name to one
file, so a duplicate means a mixed-up folder).

FP8 weights (transformers' fine-grained FP8 layout, DeepSeek-V3's Hub checkpoints). A
``config.json`` with ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [b0, b1], ...}`` stores some ``<name>.weight`` tensors as
``float8_e4m3fn`` ``w_OI`` next to a ``<name>.weight_scale_inv`` ``s`` (float32, or
``float8_e8m0fnu`` below) of shape ``[ceil(O/b0), ceil(I/b1)]`` (the last block row and column
may be partial); import reads them as::

    w[i, j] = float32(w_OI[i, j]) · s[i // b0, j // b1]

the float32 product DeepSeek's ``weight_dequant`` computes (the FP8 value converts exactly, so
it is the exact product rounded once to float32), stored in the checkpoint's ``torch_dtype``
(``dtype``; float32 when it names none), the dtype its unquantized tensors have and an
unquantized copy would store the weight in. ``get(weight)`` reads the weight and its scale
(from whichever shard holds it) and returns the dequantized weight, so neither an FP8 copy of
the model nor its scales are held beside the dequantized tensors. The scales are consumed:
:attr:`HFShards.names` lists no scale, and the family's adapter never sees one.
``activation_scheme`` is not read: it says how inference quantizes activations.

Power-of-two scales (DeepSeek-V3.1). A scale is stored as float32 or as ``float8_e8m0fnu``
(some exporters of power-of-two scales write them so): a byte ``b`` of the latter means
``2^(b − 127)`` (0xFF: NaN), which float32 holds exactly (``2^-127`` as a subnormal), so
``s`` is converted to float32 first and the formula above is unchanged, bit for bit.
``quantization_config.scale_fmt = "ue8m0"`` (DeepSeek-V3.1's config; its inference code then
rounds activation scales up to powers of two as well) declares every scale a power of two:
import checks it from the data as each float32 scale is read (``frexp``'s mantissa is 0.5;
0, a negative value, inf or NaN fail), and refuses the first that is not with one line
naming the scale tensor, the value and its block. ``scale_fmt`` absent means any float32
scale; any other value is refused when the folder is opened.

Every pairing is checked from the headers when the folder is opened, before any tensor is
read (a 690 GB checkpoint is refused in seconds, not after an hour of converting), in the
order the shards are listed, each with one line: another ``quant_method``, ``fmt`` or
``scale_fmt``, a ``weight_block_size`` that is not two positive integers, a ``torch_dtype``
other than float32/bfloat16/float16, a float8 tensor without a ``quantization_config``, of
another float8 dtype, of fewer than two dimensions or without its scale, a scale that is
neither float32 nor float8_e8m0fnu, whose shape is not ``[ceil(O/b0), ceil(I/b1)]`` or whose
weight is missing or not float8.

Writing. A folder is written as transformers' ``save_pretrained`` writes one: a model of at
most ``max_file_bytes`` tensor bytes as ``model.safetensors``; a larger one as
``model-<k>-of-<n>.safetensors`` files (k from 1) of at most ``max_file_bytes`` each (a
tensor larger than that in a file of its own) and ``model.safetensors.index.json``, whose
``weight_map`` names each tensor's file and whose ``metadata.total_size`` is the sum of the
tensors' bytes. :func:`plan_files` cuts the tensors (known ahead, with their sizes, from a
conversion of meta tensors) into files; :class:`HFWriter` holds a file's tensors until its
last one arrives, writes it into a temporary folder and publishes the folder at the end
(its docstring: a kill leaves the previous export or the new one, once
:func:`restore_interrupted_export` has run, never a mix and never a folder without them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mt_train.checkpoint.files import fsync_dir, save_safetensors
from mt_train.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"
"""``<weight name>`` + this names an FP8 weight's block scales (module docstring)."""
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu,
}  # fmt: skip
"""A header's dtype names (safetensors' ``Dtype``) as torch dtypes; others read as None."""


@dataclasses.dataclass(frozen=True)
class FP8Weights:
    """How a checkpoint's FP8 weights are read (module docstring)."""

    block: tuple[int, int]
    """``weight_block_size``: rows × columns of a weight that share one scale."""
    dtype: torch.dtype
    """What a dequantized weight is stored in (the checkpoint's ``torch_dtype``)."""
    scale_fmt: str | None = None
    """``"ue8m0"``: every scale is a power of two (checked as it is read); None: any float32."""


SCALE_FORMATS = ("ue8m0",)
"""The ``quantization_config.scale_fmt`` values import reads (besides none)."""
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
"""The dtypes a ``weight_scale_inv`` may be stored in (module docstring)."""


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
    scale_fmt = quant.get("scale_fmt")
    if scale_fmt is not None and scale_fmt not in SCALE_FORMATS:
        raise ValueError(
            f"quantization_config.scale_fmt={scale_fmt!r} is not supported; valid: "
            f"{', '.join(map(repr, SCALE_FORMATS))} (power-of-two scales, DeepSeek-V3.1's) "
            "or none (float32 scales)"
        )
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
    return FP8Weights((block[0], block[1]), _FLOAT_DTYPES[name], scale_fmt)


def scale_float32(name: str, scale: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """The scales ``name`` holds as float32 (module docstring): a ``float8_e8m0fnu`` byte ``b``
    as ``2^(b - 127)`` (NaN for 0xFF), exactly; float32 ones as they are, checked to be powers
    of two where ``scale_fmt`` is ``"ue8m0"``."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.to(torch.float32)
    if scale_fmt == "ue8m0":
        # frexp's mantissa is 0.5 exactly for a positive power of two (subnormals included),
        # and 0, NaN, inf, a negative value or any other for everything else.
        bad = torch.frexp(scale).mantissa != 0.5
        if bad.any():
            where = [int(i) for i in bad.nonzero()[0]]
            raise ValueError(
                f"{name} holds {scale[tuple(where)].item()!r} at block {where}, not a power of "
                "two, but quantization_config.scale_fmt='ue8m0' (valid: every scale 2^k, k an "
                "integer, as ue8m0 stores them; or no scale_fmt)"
            )
    return scale


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``float32(weight[..., i, j]) · scale_inv[..., i // b0, j // b1]`` in float32."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.to(torch.float32).mul_(scale)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor is stored and what it holds, from its shard's header."""

    path: Path
    dtype: torch.dtype | None
    """None: a safetensors dtype torch has no name for (reading it fails with one line)."""
    shape: tuple[int, ...]

    @property
    def is_float8(self) -> bool:
        return self.dtype is not None and self.dtype.is_floating_point and self.dtype.itemsize == 1


def _fp8_checked(
    name: str, weight: TensorInfo, scale: TensorInfo | None, block: tuple[int, int]
) -> None:
    """Refuse an FP8 weight and its scale that do not make the module docstring's pair."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{name} is {weight.dtype}; valid FP8 weights: torch.float8_e4m3fn "
            "(quantization_config.fmt='e4m3')"
        )
    if scale is None:
        raise ValueError(
            f"{name} is float8_e4m3fn without its {name}{SCALE_SUFFIX} (valid: a scale per "
            "weight block, float32 or float8_e8m0fnu)"
        )
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(
            f"{name}{SCALE_SUFFIX} is {scale.dtype}; valid: {' or '.join(map(str, SCALE_DTYPES))}"
        )
    if len(weight.shape) < 2:
        raise ValueError(f"{name} is an FP8 tensor of shape {list(weight.shape)}; valid: 2-D")
    *lead, rows, cols = weight.shape
    want = [*lead, -(-rows // block[0]), -(-cols // block[1])]
    if list(scale.shape) != want:
        raise ValueError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale.shape)}; valid for weight shape "
            f"{list(weight.shape)} and weight_block_size={list(block)}: {want}"
        )


class HFShards:
    """The tensors of a folder's ``*.safetensors`` files by name, read one at a time (module
    docstring). Use as a context manager (it holds the files open)."""

    def __init__(self, folder: Path, fp8: FP8Weights | None = None) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {str(folder)!r}")
        self.fp8 = fp8
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self._index: dict[str, TensorInfo] = {}
        try:
            for path in files:
                handle = self._stack.enter_context(self._open(path))
                self._handles[path] = handle
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    self._add(key, path, handle.get_slice(key))
            self.names = self._checked_names()
            """Every tensor :meth:`get` reads, in shard order (FP8 scales not among them)."""
            self._served = set(self.names)
        except BaseException:
            self._stack.close()
            raise

    @staticmethod
    def _open(path: Path) -> Any:
        try:
            return safe_open(str(path), framework="pt")
        except SafetensorError as err:
            raise CheckpointError(
                f"{str(path)!r} is not a readable safetensors file: {err}"
            ) from None

    def _add(self, key: str, path: Path, view: Any) -> None:
        if key in self._index:
            raise ValueError(
                f"{key} is in both {self._index[key].path.name} and {path.name} (valid: each "
                "tensor in one shard, as model.safetensors.index.json maps them)"
            )
        dtype = SAFETENSORS_DTYPES.get(view.get_dtype())
        self._index[key] = TensorInfo(path, dtype, tuple(view.get_shape()))

    def _checked_names(self) -> list[str]:
        """The names :meth:`get` serves, every FP8 pairing checked (module docstring)."""
        fp8 = self.fp8
        scales = {k for k in self._index if fp8 and k.endswith(SCALE_SUFFIX)}
        names = [k for k in self._index if k not in scales]
        for key in names:
            info = self._index[key]
            scale = key + SCALE_SUFFIX
            if info.is_float8:
                if fp8 is None:
                    raise ValueError(
                        f"{key} is {info.dtype} but config.json has no quantization_config "
                        "(valid: quant_method 'fp8' with a weight_block_size, or no float8 "
                        "tensors)"
                    )
                _fp8_checked(key, info, self._index.get(scale), fp8.block)
            elif scale in scales:
                raise ValueError(
                    f"{scale} scales {key}, which is {info.dtype}; valid: a scale only next to "
                    "a float8_e4m3fn weight"
                )
        orphans = sorted(s for s in scales if s.removesuffix(SCALE_SUFFIX) not in self._index)
        if orphans:
            name = orphans[0]
            raise ValueError(
                f"{name} has no {name.removesuffix(SCALE_SUFFIX)} in the checkpoint (valid: a "
                "scale next to the float8_e4m3fn weight it is named after)"
            )
        return names

    def __enter__(self) -> HFShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def nbytes(self, name: str) -> int:
        """Bytes of the tensor :meth:`get` returns for ``name`` (dequantized)."""
        info = self._index[name]
        dtype = self.fp8.dtype if self.fp8 and info.is_float8 else info.dtype
        return math.prod(info.shape) * (dtype.itemsize if dtype is not None else 1)

    def _read(self, name: str) -> torch.Tensor:
        path = self._index[name].path
        try:
            return self._handles[path].get_tensor(name)
        except SafetensorError as err:
            raise CheckpointError(
                f"{str(path)!r} is not a readable safetensors file: {err}"
            ) from None

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``, an FP8 weight dequantized (module docstring)."""
        if name not in self._served:
            raise KeyError(f"no tensor {name!r} in the checkpoint")
        tensor = self._read(name)
        if self.fp8 is not None and self._index[name].is_float8:
            scale_name = name + SCALE_SUFFIX
            scale = scale_float32(scale_name, self._read(scale_name), self.fp8.scale_fmt)
            tensor = dequantize_fp8(tensor, scale, self.fp8.block).to(self.fp8.dtype)
        return tensor


# --- Writing a Hugging Face folder (mt-convert export) ----------------------------------------

SINGLE_FILE = "model.safetensors"
"""The weights of a folder written as one file (transformers' name; no index then)."""
INDEX_FILE = "model.safetensors.index.json"
"""The index of a folder written in several files: ``weight_map`` and ``total_size``."""
MARKERS = (INDEX_FILE, SINGLE_FILE)
"""The files that make a folder loadable, the last of an export to be published."""
EXPORT_FILES = (*MARKERS, "config.json")
"""An export's files besides its ``model-*-of-*`` parts (:class:`HFWriter`)."""
_PART_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_TMP_PREFIX = ".tmp-export-"
_BACKUP_PREFIX = ".prev-export-"
_FILLING = ".filling"
"""Suffix of a backup folder still being filled (:class:`HFWriter`'s docstring)."""


def file_names(count: int) -> list[str]:
    """Hugging Face's names of a folder's ``count`` weight files (1-based, of ``count``)."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def plan_files(sizes: Iterable[tuple[str, int]], max_file_bytes: int | None) -> list[list[str]]:
    """Tensor names (with their bytes, in the order they will be written) cut into files of
    at most ``max_file_bytes`` tensor bytes, as ``save_pretrained``'s ``max_shard_size``
    does: a file takes names until the next one would cross the limit; a tensor larger than
    the limit gets a file of its own. None: one file."""
    if max_file_bytes is not None and max_file_bytes < 1:
        raise ValueError(f"max_file_bytes={max_file_bytes}; valid: a positive size or None")
    files: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if max_file_bytes is not None and files[-1] and used + size > max_file_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


class HFWriter:
    """Writes a Hugging Face model folder (``config.json``, the weight files of a
    :func:`plan_files` plan and, for several files, ``model.safetensors.index.json``) as
    its tensors arrive, atomically.

    :meth:`add` buffers tensors and writes a file as soon as it holds every tensor the plan
    gives it (tensors arriving in the plan's order, the buffer is at most one file plus the
    last :meth:`add`). Everything goes into ``<out_dir>/.tmp-export-<hex>/`` first;
    :meth:`close` writes the index and ``config.json`` there, then publishes. An export's
    files are ``config.json``, ``model.safetensors``, the index and ``model-*-of-*`` files
    (the other files, a tokenizer, stay); a *marker* (the index, or ``model.safetensors``)
    is what makes a folder loadable. Publishing moves files with ``os.replace`` inside
    ``out_dir`` (one filesystem) and fsyncs each phase before the next:

    1. move the previous export's files into a backup ``.prev-export-<hex>.filling``, its
       markers first (so a reader never finds a marker whose files are gone), then rename it
       ``.prev-export-<hex>`` (the folder now holds no export files);
    2. move the new files in, the marker last;
    3. delete the backup and the temporary folder.

    A kill (or a failure) leaves a state :func:`restore_interrupted_export` resolves to one
    whole export: a ``.filling`` backup (step 1) holds the previous files not yet in
    ``out_dir``, so they go back; a complete backup with no marker in ``out_dir`` (step 2)
    means the new files are partial, so they are deleted and the previous ones go back; a
    complete backup beside a marker (step 3) means the new export is whole, so the backup
    goes. The next :class:`HFWriter` on the folder, :meth:`discard` and ``mt-convert
    import`` run it first. Only one export may publish into a folder at a time (a second
    would take the first's backup for an interrupted one). A ``.tmp-export-*`` folder left
    by a killed export is removed by the next one; :meth:`discard` (on failure) also removes
    the temporary folder, and ``out_dir`` itself if this writer created it."""

    def __init__(self, out_dir: Path, plan: list[list[str]]) -> None:
        self.out_dir, self.plan = out_dir, plan
        self.files = file_names(len(plan))
        """The weight files' names, in plan order."""
        self._created = not out_dir.exists()
        out_dir.mkdir(parents=True, exist_ok=True)
        restore_interrupted_export(out_dir)
        for stale in out_dir.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp = out_dir / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        self.tmp.mkdir()
        self._file_of = {name: k for k, names in enumerate(plan) for name in names}
        self._pending = set(self._file_of)
        self._left = [len(names) for names in plan]
        self._buffer: dict[str, torch.Tensor] = {}
        self._total_size = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Buffer ``tensors`` (names of the plan, each once); write every file now complete."""
        for name, tensor in tensors.items():
            if name not in self._pending:
                raise ValueError(
                    f"tensor {name!r} is not in the export's plan (the adapter's conversion of "
                    "meta tensors) or came twice"
                )
            self._pending.remove(name)
            self._buffer[name] = tensor
            self._total_size += tensor.numel() * tensor.element_size()
            file = self._file_of[name]
            self._left[file] -= 1
            if self._left[file] == 0:
                tensors_of_file = {n: self._buffer.pop(n) for n in self.plan[file]}
                save_safetensors(tensors_of_file, self.tmp / self.files[file])

    def close(self, config: dict[str, Any]) -> None:
        """Write the index (several files) and ``config.json``, then publish (class docstring)."""
        if self._pending:
            raise ValueError(f"the export never produced the planned {sorted(self._pending)[:3]}")
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self._total_size},
                "weight_map": {n: self.files[k] for n, k in sorted(self._file_of.items())},
            }
            _write_text(self.tmp / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
        _write_text(self.tmp / "config.json", json.dumps(config, indent=2) + "\n")
        fsync_dir(self.tmp)
        backup = self.out_dir / f"{_BACKUP_PREFIX}{uuid.uuid4().hex}"
        filling = backup.with_name(backup.name + _FILLING)
        filling.mkdir()
        for old in _export_files(self.out_dir):
            os.replace(old, filling / old.name)
        fsync_dir(filling)
        os.replace(filling, backup)
        fsync_dir(self.out_dir)
        marker = INDEX_FILE if len(self.files) > 1 else SINGLE_FILE
        for name in [n for n in self.files if n != marker] + ["config.json"]:
            os.replace(self.tmp / name, self.out_dir / name)
        fsync_dir(self.out_dir)
        os.replace(self.tmp / marker, self.out_dir / marker)
        fsync_dir(self.out_dir)
        shutil.rmtree(backup)
        self.tmp.rmdir()

    def discard(self) -> None:
        """Remove what this writer wrote (after a failure; class docstring)."""
        if self._created:
            shutil.rmtree(self.out_dir, ignore_errors=True)
            return
        restore_interrupted_export(self.out_dir)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _export_files(folder: Path) -> list[Path]:
    """The export's files in ``folder`` (:class:`HFWriter`'s docstring), markers first."""
    names = {p.name for p in folder.iterdir() if p.is_file()}
    exported = [n for n in names if n in EXPORT_FILES or _PART_FILE.match(n)]
    return [folder / n for n in sorted(exported, key=lambda n: (n not in MARKERS, n))]


def restore_interrupted_export(folder: Path) -> None:
    """Resolve what a killed :meth:`HFWriter.close` left in ``folder`` to the previous export
    or the new one (:class:`HFWriter`'s docstring); nothing to do without a backup. Each
    step is an ``os.replace`` or a deletion that a rerun after a kill here finishes."""
    for backup in sorted(folder.glob(f"{_BACKUP_PREFIX}*")):
        if not backup.name.endswith(_FILLING):
            if any((folder / name).is_file() for name in MARKERS):
                shutil.rmtree(backup)
                continue
            for new in _export_files(folder):
                new.unlink()
            fsync_dir(folder)
            # As a backup still filling: whatever the folder holds now is previous files.
            filling = backup.with_name(backup.name + _FILLING)
            os.replace(backup, filling)
            backup = filling
        for old in sorted(backup.iterdir()):
            os.replace(old, folder / old.name)
        fsync_dir(folder)
        backup.rmdir()


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
