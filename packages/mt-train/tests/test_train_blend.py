"""``data.blend``: parsing, proportions, layout invariance, exact resume, tokenizer refusal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mt_train.data import ByteTokenizer, PackedDataset, train_bpe, write_prepared
from mt_train.data.blend import (
    BLOCK,
    BlendedDataset,
    BlendedSampler,
    apportion,
    check_same_tokenizer,
    data_order_change,
    parse_blend,
)
from mt_train.data.checks import check_prepared
from mt_train.data.dataset import ResumableSampler
from mt_train.errors import DataError

SIZES = (50, 300, 17)
WEIGHTS = (0.5, 0.3, 0.2)


def _steps(sampler: BlendedSampler, n: int) -> list[list[int]]:
    return [np.concatenate(sampler.next_step()).tolist() for _ in range(n)]


def test_parse_blend_normalises_and_accepts_megatron_strings() -> None:
    listed = parse_blend([{"path": "a", "weight": 3}, {"path": "b", "weight": 1}])
    assert listed == [("a", 0.75), ("b", 0.25)]
    assert parse_blend("3 a 1 b") == listed
    for bad, message in [
        ("3 a 1", "an even number of words"),
        ("x a", "weight 'x' of 'a' is not a positive number"),
        ([{"path": "a", "weight": -1}], "weight -1 of 'a'"),
        ([{"path": "a"}], "is not {path, weight}"),
        ([], "neither a list"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_blend(bad)


def test_apportion_is_exact_up_to_one() -> None:
    counts = apportion(BLOCK, WEIGHTS)
    assert counts.sum() == BLOCK
    assert np.all(np.abs(counts - BLOCK * np.asarray(WEIGHTS)) < 1)


def test_draws_follow_the_weights_within_sampling_error() -> None:
    sampler = BlendedSampler(SIZES, WEIGHTS, seed=3, global_batch=64, micro_batch=4)
    for draws in (500, 3 * BLOCK + 1000):
        sources, _ = sampler.source_draws(np.arange(draws))
        for s, p in enumerate(WEIGHTS):
            share = float(np.mean(sources == s))
            # Four binomial standard deviations: a false failure has probability < 1e-4
            # (inside a block the deal is without replacement, which only narrows it).
            assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / draws), (draws, s, share)
    # Whole blocks are exact up to one draw per block.
    sources, _ = sampler.source_draws(np.arange(2 * BLOCK))
    counts = np.bincount(sources, minlength=len(SIZES))
    assert np.all(np.abs(counts - 2 * BLOCK * np.asarray(WEIGHTS)) <= 2)


def test_each_source_walks_its_own_epoch_permutation() -> None:
    sampler = BlendedSampler(SIZES, WEIGHTS, seed=3, global_batch=64, micro_batch=4)
    samples = np.concatenate([np.concatenate(sampler.next_step()) for _ in range(40)])
    offsets = np.concatenate([[0], np.cumsum(SIZES)])
    sources, ranks = sampler.source_draws(np.arange(len(samples)))
    for s, size in enumerate(SIZES):
        mine = samples[sources == s]
        assert np.all((mine >= offsets[s]) & (mine < offsets[s + 1]))
        first_epoch = mine[ranks[sources == s] < size]
        assert len(first_epoch) == size and len(set(first_epoch.tolist())) == size


def test_blend_is_layout_invariant_and_resumes_exactly() -> None:
    reference = _steps(BlendedSampler(SIZES, WEIGHTS, 11, 16, 2), 30)
    for dp in (2, 4):
        ranks = [BlendedSampler(SIZES, WEIGHTS, 11, 16, 2, r, dp) for r in range(dp)]
        for step in reference:
            union = sorted(i for r in ranks for i in np.concatenate(r.next_step()).tolist())
            assert union == sorted(step)

    first = BlendedSampler(SIZES, WEIGHTS, 11, 16, 2)
    _steps(first, 12)
    state = first.state_dict()
    resumed = BlendedSampler(SIZES, WEIGHTS, 11, 16, 4, 1, 2)  # another dp and micro-batch
    resumed.load_state_dict(state)
    other = BlendedSampler(SIZES, WEIGHTS, 11, 16, 4, 0, 2)
    other.load_state_dict(state)
    for step in reference[12:]:
        union = np.concatenate([*resumed.next_step(), *other.next_step()]).tolist()
        assert sorted(union) == sorted(step)

    with pytest.raises(ValueError, match=r"data\.blend weights"):
        BlendedSampler(SIZES, (0.2, 0.3, 0.5), 11, 16, 2).load_state_dict(state)


def test_skipped_draws_are_never_trained_on() -> None:
    sampler = BlendedSampler(SIZES, WEIGHTS, 5, 8, 2)
    reference = _steps(BlendedSampler(SIZES, WEIGHTS, 5, 8, 2), 6)
    sampler.skip(16, 32)  # steps 2 and 3
    assert _steps(sampler, 4) == [reference[0], reference[1], reference[4], reference[5]]


def _folder(path: Path, text: str, tokenizer) -> Path:
    docs = [f"{text} {i}. " * 12 for i in range(12)]
    write_prepared(path, docs, tokenizer, val_every=4)
    return path


def test_blended_dataset_reads_rows_from_their_sources(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", "alpha", ByteTokenizer())
    b = _folder(tmp_path / "b", "beta", ByteTokenizer())
    parts = [PackedDataset(f, "train", seq_len=16) for f in (a, b)]
    blended = BlendedDataset(parts, ["a", "b"])
    indices = np.array([len(parts[0]) + 2, 1, len(parts[0])])
    batch = blended.collate(indices, documents=True)
    assert batch.inputs[0].tolist() == parts[1].collate(np.array([2])).inputs[0].tolist()
    assert batch.inputs[1].tolist() == parts[0].collate(np.array([1])).inputs[0].tolist()
    assert blended.source_of(indices).tolist() == [1, 0, 1]
    assert batch.document_ids is not None and batch.document_ids.shape == (3, 16)


def test_mismatched_tokenizers_are_refused_in_one_line(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", "alpha", ByteTokenizer())
    b = _folder(tmp_path / "b", "beta", train_bpe(["alpha beta gamma"] * 50, 300))
    metas = [check_prepared(f, 8) for f in (a, b)]
    check_same_tokenizer([a, a], [metas[0], metas[0]])
    with pytest.raises(DataError) as err:
        check_same_tokenizer([a, b], metas)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and str(a) in message and str(b) in message
    assert "different tokenizers" in message


def test_switching_between_one_folder_and_a_blend_at_resume_is_named() -> None:
    single = ResumableSampler(100, seed=11, global_batch=16, micro_batch=2)
    blended = BlendedSampler(SIZES, WEIGHTS, 11, 16, 2)
    _steps(blended, 3)
    single.next_step()
    assert data_order_change(blended.state_dict(), blended) is None
    assert data_order_change(single.state_dict(), single) is None
    into_blend = data_order_change(single.state_dict(), blended)
    assert into_blend is not None
    assert "drawn from one folder, this run draws from data.blend" in into_blend
    assert "after sample 16" in into_blend
    out_of_blend = data_order_change(blended.state_dict(), single)
    assert out_of_blend is not None and "after sample 48" in out_of_blend


def test_training_on_a_blend_reports_sources_and_resumes_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from train_checks import blend_sources, fit, tiny_overrides

    blend = blend_sources(tmp_path)

    def overrides(steps: int, **extra: object) -> list[str]:
        extra = {"data.path": None, "data.blend": blend, "trainer.max_steps": steps, **extra}
        return tiny_overrides("unused", **extra)

    whole = fit(overrides(8), tmp_path / "whole")[1].losses
    step4 = tmp_path / "whole/checkpoints/step-00000004"
    resumed = fit(overrides(8, **{"checkpoint.resume": step4}), tmp_path / "resumed")[1].losses
    assert resumed[-4:] == whole[4:]  # bit-exact: the same draws, model and optimizer state
    capsys.readouterr()
    one_folder = {
        "data.blend": None,
        "data.path": str(tmp_path / "bible"),
        "checkpoint.resume": step4,
    }
    fit(tiny_overrides("unused", **{"trainer.max_steps": 5, **one_folder}), tmp_path / "single")
    assert "samples were drawn from data.blend, this run draws from one folder" in (
        capsys.readouterr().err
    )

    records = [json.loads(line) for line in (tmp_path / "whole/metrics.jsonl").open()]
    train = [r for r in records if "tokens/bible" in r]
    last = train[-1]
    assert last["tokens/bible"] + last["tokens/verse"] == 8 * 8 * 64  # steps · batch · seq
    assert last["tokens/bible"] > last["tokens/verse"]  # weights 3:1
    evals = [r for r in records if "val_loss/bible" in r]
    assert evals and math.isfinite(evals[-1]["val_loss/verse"])
    blended = 0.75 * evals[-1]["val_loss/bible"] + 0.25 * evals[-1]["val_loss/verse"]
    assert evals[-1]["val_loss"] == pytest.approx(blended, rel=1e-9)


def test_blend_config_is_validated(tmp_path: Path) -> None:
    from mt_train import compose_config, to_train_config

    (tmp_path / "a").mkdir()
    for overrides, message in [
        ([f"data.path={tmp_path / 'a'}", f"data.blend='1 {tmp_path / 'a'}'"], "are both set"),
        ([f"data.blend='1 {tmp_path / 'missing'}'"], "source '.*missing' is not a folder"),
        ([f"data.blend='0 {tmp_path / 'a'}'"], "is not a positive number"),
    ]:
        with pytest.raises(ValueError, match=message):
            to_train_config(compose_config(overrides))
    cfg = to_train_config(compose_config([f"data.blend='2 {tmp_path / 'a'} 2 {tmp_path / 'a'}'"]))
    assert cfg.data.blend_sources == [(str(tmp_path / "a"), 0.5)] * 2
    listed = f"data.blend=[{{path: {tmp_path / 'a'}, weight: 3}}, {{path: {tmp_path}, weight: 1}}]"
    cfg = to_train_config(compose_config([listed]))
    assert cfg.data.blend_sources == [(str(tmp_path / "a"), 0.75), (str(tmp_path), 0.25)]


def test_mt_train_refuses_a_blend_of_two_tokenizers_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from cli_checks import assert_one_error_line, run_cli, run_overrides

    a = _folder(tmp_path / "a", "alpha", ByteTokenizer())
    b = _folder(tmp_path / "b", "beta", train_bpe(["alpha beta gamma"] * 50, 300))
    out = tmp_path / "run"
    overrides = run_overrides(a, out, **{"data.path": None, "data.blend": f"'1 {a} 1 {b}'"})
    status, err = run_cli(capsys, [*overrides, "trainer.seq_len=8"])
    assert_one_error_line(status, err, "data.blend sources use different tokenizers")
    assert str(a) in err and str(b) in err
