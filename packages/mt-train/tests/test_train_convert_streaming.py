"""``mt-convert import`` streams (hf_checkpoints.py's docstring): it reads and converts one
group of tensors at a time (a layer, or one projection of a layer's routed experts) and writes
the checkpoint in files of ``max_file_bytes``, yet writes, for a model below that size, the
bytes that converting the whole model at once writes.

The reference, :func:`_whole_model_import`, is the import as it was before it streamed: every
tensor of every shard in one dict (FP8 weights dequantized), one ``tensors_from_hf`` call, one
``write_shard``. The checkpoints are tiny random transformers models saved as several
Hugging Face shards, the DeepSeek-V3 one with FP8 block-scaled weights whose scales sit in
another shard than their weights. Memory is measured by counting the bytes of the tensors the
reader returned that are still alive (a weakref finalizer per tensor): streamed, the peak is
the largest group's; converted whole, it is the model's.
"""

from __future__ import annotations

import json
import re
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_train_convert_deepseek_v3 import _hf_config as _deepseek_config
from test_train_convert_deepseek_v3_fp8 import BLOCK, HUB_FP8, _quantize

from mt_train.checkpoint.files import (
    CheckpointReader,
    checkpoint_folder,
    publish,
    tmp_dir,
    verify_checkpoint,
    write_shard,
)
from mt_train.hf_checkpoints import (
    SCALE_SUFFIX,
    dequantize_fp8,
    family_for_architectures,
    fp8_weights,
    full_model_tensors,
    import_hf,
    import_manifest,
    main,
)
from mt_train.hf_shards import HFShards

transformers = pytest.importorskip(
    "transformers", reason="the test extra: pip install 'mt-train[test]'"
)

LAYERS = 8


def _save_sharded(folder: Path, config: dict, tensors: dict[str, torch.Tensor], n: int) -> Path:
    """``tensors`` in ``n`` shards, names dealt round-robin (a layer, and an FP8 weight and its
    scale, end up in different shards)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    for i in range(n):
        part = {k: tensors[k] for k in names[i::n]}
        save_file(part, str(folder / f"model-{i + 1:05d}-of-{n:05d}.safetensors"))
    return folder


def _saved(model, root: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    model.save_pretrained(root, safe_serialization=True)
    (file,) = root.glob("*.safetensors")
    return json.loads((root / "config.json").read_text()), load_file(str(file))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Hugging Face folders of several shards: Llama (LAYERS layers; and tied), Mixtral and
    DeepSeek-V3 with FP8 weights."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    llama = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    config, tensors = _saved(transformers.LlamaForCausalLM(llama), root / "llama_saved")
    out["llama"] = _save_sharded(root / "llama", config, tensors, 3)
    llama.tie_word_embeddings, llama.num_hidden_layers = True, 2
    config, tensors = _saved(transformers.LlamaForCausalLM(llama), root / "tied_saved")
    out["llama_tied"] = _save_sharded(root / "llama_tied", config, tensors, 2)
    mixtral = transformers.MixtralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    config, tensors = _saved(transformers.MixtralForCausalLM(mixtral), root / "mixtral_saved")
    out["mixtral"] = _save_sharded(root / "mixtral", config, tensors, 2)
    deepseek = _deepseek_config(24)
    deepseek.intermediate_size, deepseek.moe_intermediate_size = 80, 20
    config, tensors = _saved(transformers.DeepseekV3ForCausalLM(deepseek), root / "ds_saved")
    fp8: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if HUB_FP8.search(name):
            fp8[name], fp8[f"{name}{SCALE_SUFFIX}"] = _quantize(tensor)
        else:
            fp8[name] = tensor
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": list(BLOCK)}  # fmt: skip
    out["deepseek_fp8"] = _save_sharded(root / "deepseek_fp8", config, fp8, 5)
    return out


def _whole_model_import(folder: Path, out_root: Path) -> Path:
    """The import as it was before it streamed (module docstring)."""
    hf = json.loads((folder / "config.json").read_text())
    family, adapter = family_for_architectures(hf)
    fp8 = fp8_weights(hf)
    raw: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        raw.update(load_file(str(path)))
    tensors = {}
    for name, tensor in raw.items():
        if fp8 is not None and name.endswith(SCALE_SUFFIX):
            continue
        if fp8 is not None and tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_fp8(tensor, raw[name + SCALE_SUFFIX], fp8.block).to(fp8.dtype)
        tensors[name] = tensor
    hf, _ = adapter.import_view(hf, set(tensors), None)
    cfg = adapter.config_from_hf(hf, folder.name)
    state = {f"model/{k}": v for k, v in adapter.tensors_from_hf(tensors, hf).items()}
    write_shard(tmp_dir(out_root, 0), 0, "reference", state)
    return publish(out_root, 0, 1, "reference", import_manifest(cfg, family, folder), 1)


def _groups(folder: Path) -> list[list[str]]:
    hf = json.loads((folder / "config.json").read_text())
    _, adapter = family_for_architectures(hf)
    with HFShards(folder, fp8_weights(hf)) as shards:
        hf, _ = adapter.import_view(hf, set(shards.names), None)
        return adapter.import_groups(shards.names, hf)


@pytest.mark.parametrize("name", ["llama", "llama_tied", "mixtral", "deepseek_fp8"])
def test_streamed_import_writes_the_whole_model_conversions_bytes(
    checkpoints, name: str, tmp_path: Path
) -> None:
    folder = checkpoints[name]
    assert len(_groups(folder)) > 2  # it did stream: the groups are layers and expert parts
    got = import_hf(folder, tmp_path / "streamed", log=lambda line: None)
    want = _whole_model_import(folder, tmp_path / "whole")
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir()) == [
        "manifest.json", "rank-00000.json", "rank-00000.safetensors",
    ]  # fmt: skip
    for file in ("manifest.json", "rank-00000.safetensors"):
        assert (got / file).read_bytes() == (want / file).read_bytes(), file
    sidecars = [json.loads((p / "rank-00000.json").read_text()) for p in (got, want)]
    assert [{k: v for k, v in s.items() if k != "run_id"} for s in sidecars] == [
        {k: v for k, v in sidecars[1].items() if k != "run_id"}
    ] * 2


@pytest.mark.parametrize("name", ["llama", "deepseek_fp8"])
def test_a_model_above_max_file_bytes_is_written_in_parts(
    checkpoints, name: str, tmp_path: Path
) -> None:
    """Parts of at least ``max_file_bytes`` (each its last group past the limit), listed in
    the manifest as ranks are: verified, read and loaded like one file."""
    folder, limit = checkpoints[name], 40_000
    whole = import_hf(folder, tmp_path / "whole", log=lambda line: None)
    status = main(["import", str(folder), str(tmp_path / "parts"), "--max-file-gb", "4e-5"])
    parts = checkpoint_folder(tmp_path / "parts")
    assert status == 0 and verify_checkpoint(parts) is None
    manifest = json.loads((parts / "manifest.json").read_text())
    files = sorted(manifest["shards"])
    assert len(files) > 3 and files == [
        f"rank-00000-part-{k:05d}.safetensors" for k in range(len(files))
    ]
    sizes = [(parts / f).stat().st_size for f in files]
    assert all(size >= limit for size in sizes[:-1]), sizes
    assert sorted(p.name for p in parts.glob("*.safetensors")) == files
    got, want = (full_model_tensors(CheckpointReader(p)) for p in (parts, whole))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in got)


class LiveBytes:
    """Bytes of the tensors ``HFShards.get`` returned that are still alive, and the peak."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, size)
        return tensor

    def _free(self, size: int) -> None:
        self.live -= size


def _peak_import(folder: Path, out: Path, monkeypatch, whole: bool = False) -> int:
    """Peak live bytes read while importing ``folder`` (``whole``: one group, as before)."""
    meter, get = LiveBytes(), HFShards.get
    monkeypatch.setattr(HFShards, "get", lambda self, name: meter.track(get(self, name)))
    if whole:
        _, adapter = family_for_architectures(json.loads((folder / "config.json").read_text()))
        monkeypatch.setattr(type(adapter), "import_groups", lambda self, names, hf: [names])
    import_hf(folder, out, log=lambda line: None, max_file_bytes=1)
    monkeypatch.undo()
    assert meter.live == 0
    return meter.peak


@pytest.mark.parametrize("name", ["llama", "deepseek_fp8"])
def test_import_holds_one_group_of_tensors_at_a_time(
    checkpoints, name: str, tmp_path: Path, monkeypatch
) -> None:
    folder = checkpoints[name]
    hf = json.loads((folder / "config.json").read_text())
    with HFShards(folder, fp8_weights(hf)) as shards:
        total = sum(shards.nbytes(n) for n in shards.names)
        layer = sum(shards.nbytes(n) for n in shards.names if n.startswith("model.layers.1."))
        largest = max(sum(shards.nbytes(n) for n in group) for group in _groups(folder))
    peak = _peak_import(folder, tmp_path / "streamed", monkeypatch)
    # Converted whole (today's import before it streamed), the whole model is alive at once:
    # the meter sees it, so the bound below is one this measure can fail.
    assert _peak_import(folder, tmp_path / "whole", monkeypatch, whole=True) == total
    # Llama: a layer of LAYERS; DeepSeek: the embedding and head (a layer's routed experts
    # are read one projection at a time), below a layer of its three.
    assert peak == largest <= layer < total / 3, (peak, layer, total)
    print(f"{name}: peak live bytes {peak} streamed, {total} whole (a layer: {layer})")


def test_import_is_refused_before_anything_is_written(checkpoints, tmp_path: Path) -> None:
    """The FP8 pairing is checked from the shards' headers, a duplicate name is refused, and
    a name the config does not have stops the import at its group; nothing is left behind."""
    folder = checkpoints["deepseek_fp8"]
    hf = json.loads((folder / "config.json").read_text())
    weight = "model.layers.2.mlp.experts.3.down_proj.weight"
    broken = tmp_path / "no_scale"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(hf))
    for path in folder.glob("*.safetensors"):  # the scale sits in another shard than its weight
        tensors = {k: v for k, v in load_file(str(path)).items() if k != weight + SCALE_SUFFIX}
        save_file(tensors, str(broken / path.name))
    with pytest.raises(ValueError, match=re.escape(f"{weight} is float8_e4m3fn without its")):
        import_hf(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    llama = checkpoints["llama"]
    twice = tmp_path / "twice"
    twice.mkdir()
    for path in llama.iterdir():
        (twice / path.name).write_bytes(path.read_bytes())
    first = sorted(twice.glob("*.safetensors"))[0]
    name = next(iter(load_file(str(first))))
    save_file({name: torch.zeros(1)}, str(twice / "extra.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"{name} is in both ")):
        import_hf(twice, tmp_path / "out")

    stray = tmp_path / "stray"
    stray.mkdir()
    for path in llama.iterdir():
        (stray / path.name).write_bytes(path.read_bytes())
    save_file({"model.layers.99.input_layernorm.weight": torch.ones(64)}, str(stray / "x.st"))
    (stray / "x.st").rename(stray / "x.safetensors")
    with pytest.raises(ValueError, match=re.escape("match the config: extra ['model/layers.99")):
        import_hf(stray, tmp_path / "out", max_file_bytes=1)
    assert not (tmp_path / "out").exists()

    short = tmp_path / "short"
    short.mkdir()
    for path in llama.iterdir():
        if path.suffix != ".safetensors":
            (short / path.name).write_bytes(path.read_bytes())
            continue
        kept = {k: v for k, v in load_file(str(path)).items() if ".7.mlp.up_proj" not in k}
        save_file(kept, str(short / path.name))
    (tmp_path / "existing").mkdir()
    with pytest.raises(ValueError, match=re.escape("missing ['model/layers.7.mlp.up_proj")):
        import_hf(short, tmp_path / "existing", max_file_bytes=1)
    assert list((tmp_path / "existing").iterdir()) == []
