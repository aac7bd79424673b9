"""``mt-convert export`` streams (hf_checkpoints.py's docstring): it plans from the files'
headers, then reads and converts one group of tensors at a time (a layer, or one stacked
projection of a layer's routed experts) and writes Hugging Face files of at most
``max_file_bytes`` with an index, yet writes, for a model below that size, the bytes that
converting the whole model at once writes.

The reference, :func:`_whole_model_export`, is the export as it was before it streamed: every
model tensor in one dict, one ``tensors_to_hf`` call, one ``save_file`` (the one-file output
of the streamed export was also compared, once, with the export of the commit before it
streamed: identical for Llama, Mixtral, DeepSeek-V3 and LLaVA checkpoints like these). The checkpoints are tiny mt models written as mt
checkpoints (no transformers needed): an 8-layer Llama, the same with its q_proj weights
stored as TP slices, its up_proj weights as FSDP2 pieces and a quarter of it in bf16 (so the
export upcasts to float32), a bf16 Mixtral-shaped MoE (its float32 aux-loss-free bias is not
exported, so the export stays bf16) and a DeepSeek-V3 with two MTP modules. Memory is
measured as the import's is (test_train_convert_streaming.py), by weakref finalizers: here
the bytes of the storages alive at once among the tensors the checkpoint reader returned and
those handed to the file writer (:class:`LiveStorages`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from mt_train.checkpoint.files import (
    CheckpointReader,
    checkpoint_folder,
    publish,
    tmp_dir,
    write_shard,
)
from mt_train.hf_checkpoints import (
    _load_tensor,
    export_dtypes,
    export_hf,
    full_model_tensors,
    import_hf,
    load_model,
    main,
    model_config_of,
    model_keys,
)
from mt_train.hf_shards import HFWriter
from mt_train.models import model_sizes
from mt_train.models.build import build_model
from mt_train.models.registry import family_of

LAYERS = 8


def _save(root: Path, cfg, tensors: dict[str, torch.Tensor], **manifest) -> Path:
    """An mt checkpoint root of ``tensors`` (stored names, ``model/`` prefixed), one rank."""
    write_shard(tmp_dir(root, 0), 0, "test", tensors)
    fields = dataclasses.asdict(cfg)
    manifest = {"step": 0, "config": {"model": fields}, "model": fields, "data": None,
                "model_family": family_of(cfg).name, "world_size": 1, "tp_plan": {},
                "parallel": {"tp": 1, "dp": 1}, **manifest}  # fmt: skip
    return publish(root, 0, 1, "test", manifest, keep_last=1)


def _pieced(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """``state`` stored as training writes it under tp=2 and FSDP2: q_proj as two TP slices
    (dim 0), up_proj as two flat element ranges; the stored tensors, tp_plan, sharded_shapes."""
    tensors, plan, shapes = {}, {}, {}
    for key, value in state.items():
        if key.endswith("q_proj.weight"):
            plan[key] = 0
            for r, part in enumerate(value.chunk(2, dim=0)):
                tensors[f"model/{key}@tp{r}of2"] = part.clone()
        elif key.endswith("up_proj.weight"):
            flat, half = value.reshape(-1), value.numel() // 2
            shapes[f"model/{key}"] = list(value.shape)
            for a, b in ((0, half), (half, value.numel())):
                tensors[f"model/{key}@elems{a}-{b}of{value.numel()}"] = flat[a:b].clone()
        else:
            tensors[f"model/{key}"] = value
    return tensors, plan, shapes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mt")
    sizes = model_sizes()
    llama = dataclasses.replace(sizes["debug"], vocab_size=64, dim=64, n_layers=LAYERS, ffn_dim=128)
    state = build_model(llama, "cpu", seed=0).state_dict()
    mixed = {k: v.bfloat16() if ".1." in k or ".2." in k else v for k, v in state.items()}
    tensors, plan, shapes = _pieced(mixed)
    out = {"llama": _save(root / "llama", llama, {f"model/{k}": v for k, v in state.items()})}
    out["llama_pieces"] = _save(
        root / "llama_pieces", llama, tensors, tp_plan=plan, sharded_shapes=shapes
    )
    tiny = sizes["mixtral_tiny"]
    moe = dataclasses.replace(
        tiny, vocab_size=64, dim=64, n_layers=2, ffn_dim=64,
        moe=dataclasses.replace(tiny.moe, num_experts=4, expert_ffn_dim=32),
    )  # fmt: skip
    state = build_model(moe, "cpu", seed=0).state_dict()
    bf16 = {f"model/{k}": v if "expert_bias" in k else v.bfloat16() for k, v in state.items()}
    out["mixtral_bf16"] = _save(root / "mixtral_bf16", moe, bf16)
    deepseek = dataclasses.replace(sizes["deepseek_v3_tiny"], vocab_size=64, n_layers=2)
    deepseek = dataclasses.replace(deepseek, mtp_depth=2)
    state = build_model(deepseek, "cpu", seed=0).state_dict()
    out["deepseek"] = _save(
        root / "deepseek", deepseek, {f"model/{k}": v for k, v in state.items()}
    )
    return out


def _whole_model_export(root: Path) -> tuple[bytes, dict]:
    """The export as it was before it streamed (module docstring): the bytes of its
    model.safetensors and its config.json."""
    reader = CheckpointReader(checkpoint_folder(root))
    cfg = model_config_of(reader)
    adapter = family_of(cfg).hf
    tensors = adapter.tensors_to_hf(full_model_tensors(reader), cfg)
    dtypes = {t.dtype for t in tensors.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    return save(tensors, metadata={"format": "pt"}), adapter.config_to_hf(cfg, dtype)


def _groups(root: Path) -> list[list[str]]:
    reader = CheckpointReader(checkpoint_folder(root))
    cfg = model_config_of(reader)
    return family_of(cfg).hf.export_groups(model_keys(reader), cfg)


@pytest.mark.parametrize("name", ["llama_pieces", "mixtral_bf16", "deepseek"])
def test_streamed_export_writes_the_whole_model_conversions_bytes(
    checkpoints, name: str, tmp_path: Path
) -> None:
    assert len(_groups(checkpoints[name])) > 2  # it did stream: layers and expert projections
    got = export_hf(checkpoints[name], tmp_path / "hf")
    weights, config = _whole_model_export(checkpoints[name])
    assert sorted(p.name for p in got.iterdir()) == ["config.json", "model.safetensors"]
    assert (got / "model.safetensors").read_bytes() == weights
    assert json.loads((got / "config.json").read_text()) == config
    assert config["torch_dtype"] == {"llama_pieces": "float32", "mixtral_bf16": "bfloat16",
                                     "deepseek": "float32"}[name]  # fmt: skip


def test_export_keeps_dtypes_only_where_from_pretrained_loads_them_back() -> None:
    """One dtype, or one dtype beside float32 tensors the HF model keeps in float32 (the
    adapter's ``float32_names``): each tensor in its own, ``torch_dtype`` the shared one. Any
    other mix: float32 for all (transformers would round float32 tensors to a bf16
    ``torch_dtype``; the DeepSeek-V3 case is loaded in transformers by
    test_train_convert_deepseek_v3_fp8.py)."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    kept = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    bias, gate = "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"
    for dtypes, config_dtype in [
        ({"a.weight": bf16, "b.weight": bf16}, bf16),
        ({"a.weight": fp32}, fp32),
        ({"a.weight": bf16, bias: fp32, gate: bf16}, bf16),
        ({"a.weight": fp16, bias: fp32, gate: fp32}, fp16),
        ({bias: fp32, gate: fp32}, fp32),
    ]:
        assert export_dtypes(dtypes, kept) == (config_dtype, dtypes), dtypes
    for dtypes, names in [
        ({"a.weight": bf16, "b.weight": fp32}, kept),  # b is no tensor HF keeps in float32
        ({"a.weight": bf16, bias: fp32}, ()),  # an adapter without float32_names
        ({"a.weight": bf16, "b.weight": fp16, bias: fp32}, kept),
        ({"a.weight": bf16, bias: bf16, gate: fp16}, kept),  # kept only when float32
    ]:
        assert export_dtypes(dtypes, names) == (fp32, dict.fromkeys(dtypes, fp32)), dtypes


def _tensor_bytes(path: Path) -> dict[str, int]:
    """The bytes of each tensor of a safetensors file, from its header."""
    itemsize = {"F32": 4, "BF16": 2}
    with safe_open(str(path), framework="pt") as f:
        views = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118 (not a mapping)
        return {k: math.prod(v.get_shape()) * itemsize[v.get_dtype()] for k, v in views.items()}


@pytest.mark.parametrize("name", ["llama", "deepseek"])
def test_an_export_above_max_file_bytes_is_written_in_indexed_files(
    checkpoints, name: str, tmp_path: Path
) -> None:
    """Files of at most the limit (a tensor above it alone), named and indexed as
    ``save_pretrained`` names them; the same tensors as the one-file export; imported back,
    the mt checkpoint's tensors bit for bit."""
    limit = 40_000
    status = main(["export", str(checkpoints[name]), str(tmp_path / "hf"), "--max-file-gb", "4e-5"])
    assert status == 0
    folder = tmp_path / "hf"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    n = len(files)
    assert n > 3 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    held = {file: _tensor_bytes(folder / file) for file in files}
    assert index["weight_map"] == {t: f for f, tensors in held.items() for t in tensors}
    assert index["metadata"] == {"total_size": sum(sum(t.values()) for t in held.values())}
    for tensors in held.values():
        assert sum(tensors.values()) <= limit or len(tensors) == 1, tensors
    whole = export_hf(checkpoints[name], tmp_path / "whole")
    with safe_open(str(whole / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(index["weight_map"])
        for tensor_name, file in index["weight_map"].items():
            with safe_open(str(folder / file), framework="pt") as part:
                assert torch.equal(part.get_tensor(tensor_name), f.get_tensor(tensor_name))
    back = import_hf(folder, tmp_path / "mt", log=lambda line: None)
    got = full_model_tensors(CheckpointReader(back))
    want = full_model_tensors(CheckpointReader(checkpoint_folder(checkpoints[name])))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in got)


class LiveStorages:
    """Bytes of the storages alive at once among the tensors the reader returned and the
    tensors handed to the writer (a conversion's new tensors: RoPE-reordered rows, casts,
    clones), and the peak. A storage is counted once, through the tensor that owns it (the
    view's ``_base``): a view the writer holds keeps it alive."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        owner = tensor if tensor._base is None else tensor._base
        if id(owner) not in self._alive:
            size = owner.untyped_storage().nbytes()
            self._alive.add(id(owner))
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(owner, self._free, id(owner), size)
        return tensor

    def _free(self, owner: int, size: int) -> None:
        self._alive.discard(owner)
        self.live -= size


def _peak_export(root: Path, out: Path, monkeypatch, max_file_bytes, whole=False) -> int:
    """Peak live bytes while exporting ``root`` (``whole``: one group, as before)."""
    meter, read, add = LiveStorages(), CheckpointReader.read, HFWriter.add

    def tracked_read(self, names):
        return {k: meter.track(v) for k, v in read(self, names).items()}

    def tracked_add(self, tensors):
        add(self, {k: meter.track(v) for k, v in tensors.items()})

    monkeypatch.setattr(CheckpointReader, "read", tracked_read)
    monkeypatch.setattr(HFWriter, "add", tracked_add)
    if whole:
        adapter = family_of(model_config_of(CheckpointReader(checkpoint_folder(root)))).hf
        monkeypatch.setattr(type(adapter), "export_groups", lambda self, names, cfg: [names])
    export_hf(root, out, max_file_bytes=max_file_bytes)
    monkeypatch.undo()
    assert meter.live == 0
    return meter.peak


@pytest.mark.parametrize("name", ["llama", "deepseek"])
def test_export_holds_one_group_and_one_file_at_a_time(
    checkpoints, name: str, tmp_path: Path, monkeypatch
) -> None:
    root = checkpoints[name]
    reader = CheckpointReader(checkpoint_folder(root))
    stored = reader.read(reader.names("model/"))
    total = sum(t.numel() * t.element_size() for t in stored.values())
    size = {k.removeprefix("model/"): t.numel() * t.element_size() for k, t in stored.items()}
    del stored
    largest = max(sum(size[k] for k in group) for group in _groups(root))
    layer = sum(s for k, s in size.items() if k.startswith("layers.1."))
    # Each tensor in a file of its own: a file is written as soon as its tensor arrives.
    peak = _peak_export(root, tmp_path / "streamed", monkeypatch, max_file_bytes=1)
    # The meter sees the writer's buffer (one file: everything is held until the end; the
    # DeepSeek MTP copies of the embedding and head come on top) and a whole-model
    # conversion (one group), so the bounds below are ones it can fail.
    assert _peak_export(root, tmp_path / "one_file", monkeypatch, None) >= total
    assert _peak_export(root, tmp_path / "whole", monkeypatch, 1, whole=True) >= total
    # Llama: a layer of LAYERS; DeepSeek: its dense first layer, below a MoE layer (whose
    # routed experts are read one projection at a time).
    assert peak == largest <= layer < total / 3, (peak, layer, total)
    limit = total // 5
    bounded = _peak_export(root, tmp_path / "limited", monkeypatch, limit)
    assert largest < bounded <= limit + largest < total, (bounded, limit, largest, total)
    print(f"{name}: peak live bytes {peak} (limit 1), {bounded} (limit {limit}), {total} whole")


def test_a_failed_export_leaves_no_output_that_looks_complete(
    checkpoints, tmp_path: Path, capsys
) -> None:
    """A conversion that fails after files were written (a Mixtral whose aux-loss-free bias
    is non-zero, found when its layer is read) leaves a new folder absent and an earlier
    export untouched; a later export replaces the earlier weights, keeps the other files."""
    root = checkpoints["mixtral_bf16"]
    reader = CheckpointReader(checkpoint_folder(root))
    tensors = reader.read(reader.names("model/"))
    tensors["model/layers.1.mlp.router.expert_bias"] = torch.full((4,), 0.5)
    broken = _save(tmp_path / "broken", model_config_of(reader), tensors)
    args = ["--max-file-gb", "1e-5"]
    assert main(["export", str(broken), str(tmp_path / "new"), *args]) != 0
    assert "layers.1.mlp.router.expert_bias is non-zero" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()

    folder = tmp_path / "existing"
    export_hf(root, folder)
    (folder / "tokenizer.json").write_text("{}")
    (folder / ".tmp-export-killed").mkdir()  # what a killed export leaves
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert main(["export", str(broken), str(folder), *args]) != 0
    assert sorted(p.name for p in folder.iterdir()) == sorted(before)
    assert all((folder / name).read_bytes() == data for name, data in before.items())
    assert main(["export", str(root), str(folder), "--max-file-gb", "0"]) != 0
    assert "--max-file-gb=0.0; valid: a positive size" in capsys.readouterr().err
    assert main(["export", str(root), str(folder), *args]) == 0
    names = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert "tokenizer.json" in names and not any(n.startswith(".tmp") for n in names)


def test_load_model_reads_one_tensor_at_a_time(checkpoints, monkeypatch) -> None:
    """``load_model`` fills the model tensor by tensor (TP slices and FSDP2 pieces re-joined,
    bf16 tensors cast into the float32 model as ``load_state_dict`` casts them): besides the
    model, the largest tensor is all it holds."""
    root = checkpoints["llama_pieces"]
    want = full_model_tensors(CheckpointReader(checkpoint_folder(root)))
    meter, read = LiveStorages(), CheckpointReader.read
    monkeypatch.setattr(
        CheckpointReader,
        "read",
        lambda self, names: {k: meter.track(v) for k, v in read(self, names).items()},
    )
    model = load_model(root)
    monkeypatch.undo()
    largest = max(t.numel() * t.element_size() for t in want.values())
    assert meter.live == 0 and meter.peak == largest
    state = model.state_dict()
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k], want[k].float()) for k in state)


def test_a_tensor_its_module_does_not_take_is_refused() -> None:
    """Tensor-by-tensor loading goes through the owning module's ``load_state_dict`` with
    ``strict=False``; a name that module does not take raises instead of being dropped."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"module '0' takes no 'scale'"):
        _load_tensor(model, "0.scale", torch.ones(2), torch.Size([2]))
    _load_tensor(model, "0.bias", torch.ones(2), torch.Size([2]))
    assert torch.equal(model[0].bias.detach(), torch.ones(2))
