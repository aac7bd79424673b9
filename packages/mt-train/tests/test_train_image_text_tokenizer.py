"""Image-text data with a Hugging Face tokenizer: the image token id (the vocabulary's own
``<image>`` or one appended), uint32 ids past 65,536, atomic publication, and the start-up
check that holds a vision-language model to the folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mt_train.data import DataModule, image_text
from mt_train.data.checks import check_image_text, check_prepared
from mt_train.data.image_text import IGNORE_INDEX
from mt_train.data.prepare import main as prepare_main
from mt_train.data.tokenizer import EOS_TOKEN, HFTokenizer, train_bpe
from mt_train.errors import DataError
from mt_train.models.llama.config import LlamaConfig
from mt_train.models.vlm.config import VLMConfig

CAPTIONS = ["a red circle", "two blue squares", "no shapes at all", "one green dot"]


def _records(folder: Path, n: int = 6) -> list[dict]:
    rng = np.random.default_rng(0)
    records = []
    for i in range(n):
        np.save(folder / f"img{i}.npy", rng.integers(0, 256, (3, 4, 4)).astype(np.uint8))
        text = CAPTIONS[i % len(CAPTIONS)]
        records.append({"image": f"img{i}.npy", "prompt": "<image>what is it?", "text": text})
    return records


def _prepare(folder: Path, records: list[dict], *extra: str, out: str = "out") -> int:
    path = folder / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return prepare_main(
        [str(path), "--out", str(folder / out), "--image-text", "--image-shape", "3", "4", "4",
         "--image-tokens", "4", "--val-every", "2", *extra]
    )  # fmt: skip


def _bpe(folder: Path, with_image_token: bool) -> tuple[Path, HFTokenizer]:
    tokenizer = train_bpe(CAPTIONS * 20 + ["what is it?"] * 20, 300)
    if with_image_token:
        tokenizer.tokenizer.add_special_tokens(["<image>"])  # type: ignore[attr-defined]
        tokenizer = HFTokenizer(tokenizer.tokenizer)
    path = folder / "tok.json"
    tokenizer.tokenizer.save(str(path))  # type: ignore[attr-defined]
    return path, tokenizer


@pytest.mark.parametrize("with_image_token", [False, True], ids=["appended", "in_vocab"])
def test_a_tokenizer_json_tokenizes_the_text_and_places_the_image_id(
    tmp_path: Path, with_image_token: bool
) -> None:
    path, tokenizer = _bpe(tmp_path, with_image_token)
    assert _prepare(tmp_path, _records(tmp_path), "--tokenizer", str(path)) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    if with_image_token:
        # llava-hf's layout: <image> is the vocabulary's last token, no id appended.
        assert meta["image_token_id"] == tokenizer.tokenizer.token_to_id("<image>")  # type: ignore[attr-defined]
        assert meta["vocab_size"] == tokenizer.vocab_size
    else:
        assert meta["image_token_id"] == tokenizer.vocab_size
        assert meta["vocab_size"] == tokenizer.vocab_size + 1
    assert meta["tokenizer"] == "tokenizer.json" and meta["dtype"] == "uint16"
    assert meta["eos_id"] == tokenizer.eos_id == tokenizer.tokenizer.token_to_id(EOS_TOKEN)  # type: ignore[attr-defined]
    check_prepared(tmp_path / "out", 32)
    data = DataModule(tmp_path / "out", seq_len=32)
    assert data.vocab_size == meta["vocab_size"]
    batch = data.train.collate(np.array([0, 1]))
    for row, record in enumerate((0, 2)):  # train samples are records 0, 2, 4
        inputs = batch.inputs[row].tolist()
        assert inputs.count(meta["image_token_id"]) == 4
        trained = [t for t in batch.targets[row].tolist() if t != IGNORE_INDEX]
        # The caption's ids (as the tokenizer encodes it alone) and EOS carry the loss.
        assert trained == [*tokenizer.encode(CAPTIONS[record]), tokenizer.eos_id]
        assert data.tokenizer.decode(trained[:-1]) == CAPTIONS[record]


def test_a_bos_the_tokenizer_adds_opens_the_sample_once(tmp_path: Path) -> None:
    from tokenizers import processors

    tokenizer = train_bpe(CAPTIONS * 20 + ["what is it?"] * 20, 300)
    tokenizer.tokenizer.add_special_tokens(["<s>"])  # type: ignore[attr-defined]
    bos = tokenizer.tokenizer.token_to_id("<s>")  # type: ignore[attr-defined]
    tokenizer.tokenizer.post_processor = processors.TemplateProcessing(  # type: ignore[attr-defined]
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tokenizer.tokenizer.save(str(tmp_path / "tok.json"))  # type: ignore[attr-defined]
    assert tokenizer.encode("what")[0] == bos  # as Llama's tokenizer.json does
    assert _prepare(tmp_path, _records(tmp_path), "--tokenizer", str(tmp_path / "tok.json")) == 0
    data = DataModule(tmp_path / "out", seq_len=32)
    inputs = data.train.collate(np.array([0])).inputs[0].tolist()
    image = data.train.meta["image_token_id"]
    prompt = tokenizer.encode_piece("what is it?")
    caption = tokenizer.encode_piece(CAPTIONS[0])
    assert inputs[: 1 + 4 + len(prompt) + len(caption)] == [bos, *[image] * 4, *prompt, *caption]
    assert inputs.count(bos) == 1


def test_ids_past_65536_are_stored_as_uint32(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{k}" for k in range(70_000)]
    vocab = {EOS_TOKEN: 0, "[UNK]": 1, **{w: k + 2 for k, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    records = _records(tmp_path)
    for k, record in enumerate(records):
        record["text"] = f"w{69_990 + k} w{k}"
    assert _prepare(tmp_path, records, "--tokenizer", str(tmp_path / "big.json")) == 0
    meta = check_prepared(tmp_path / "out", 16)
    assert meta["dtype"] == "uint32" and meta["image_token_id"] == 70_002
    assert meta["max_token_id"] == 70_002
    data = DataModule(tmp_path / "out", seq_len=16)
    trained = [t for t in data.train.collate(np.array([1])).targets[0].tolist() if t >= 0]
    assert trained == [69_992 + 2, 2 + 2, 0]  # record 2's words, then EOS


def test_a_failed_preparation_leaves_the_previous_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    assert _prepare(tmp_path, _records(tmp_path)) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    path, _ = _bpe(tmp_path, with_image_token=False)

    def disk_full(folder: Path, meta: dict) -> None:
        raise OSError(28, "No space left on device", str(folder / "meta.json"))

    # Every token and image file of the new folder is written when its meta.json fails.
    monkeypatch.setattr(image_text, "write_meta", disk_full)
    assert _prepare(tmp_path, _records(tmp_path), "--tokenizer", str(path)) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_bpe_is_refused_for_image_text(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _prepare(tmp_path, _records(tmp_path), "--tokenizer", "bpe") == 2
    assert "--image-text takes --tokenizer byte" in capsys.readouterr().err


def test_the_model_must_read_the_folder_as_prepared(tmp_path: Path) -> None:
    assert _prepare(tmp_path, _records(tmp_path)) == 0
    meta = check_prepared(tmp_path / "out", 16)
    model = VLMConfig(vocab_size=258)
    model.vision.channels, model.vision.image_size, model.vision.patch_size = 3, 4, 2
    check_image_text(meta, model, "out")  # 257, (4/2)² = 4 tokens, [3, 4, 4]: it matches
    check_image_text({"kind": None}, LlamaConfig(), "text")  # a text folder passes
    cases = [
        (dict(image_token_id=200), r"image_token_id=257, but model\.image_token_id is 200"),
        (dict(patch_size=1), r"image_tokens=4, but the model's image tokens is 16"),
        (dict(channels=1), r"image_shape=\[3, 4, 4\], but \[model\.vision\.channels, .*\] is \[1, 4, 4\]"),
    ]  # fmt: skip
    for change, message in cases:
        wrong = VLMConfig(vocab_size=258, image_token_id=change.get("image_token_id", 257))
        wrong.vision.channels = change.get("channels", 3)
        wrong.vision.image_size, wrong.vision.patch_size = 4, change.get("patch_size", 2)
        with pytest.raises(DataError, match=message):
            check_image_text(meta, wrong, "out")
    with pytest.raises(DataError, match="holds image-text samples; train it with a vision"):
        check_image_text(meta, LlamaConfig(), "out")
