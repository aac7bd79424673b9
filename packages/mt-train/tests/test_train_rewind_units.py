"""Rewind's parts on their own: the median/MAD baseline against a float64 reference, the
detectors' warm-up and priorities, the stable rule, the sampler's skipped ranges, the LR
cool-down, checkpoint verification, and the events log format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from train_checks import tiny_overrides

from mt_train import Trainer, compose_config, to_train_config
from mt_train.checkpoint import verify_checkpoint
from mt_train.config import RewindConfig
from mt_train.data import ResumableSampler
from mt_train.rewind import (
    DetectorSuite,
    EventLog,
    RewindManager,
    RobustBaseline,
    StepSignals,
    Target,
    Targets,
    agree,
    console_line,
    read_events,
)


def test_baseline_matches_float64_reference() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(2.5, 0.1, size=80)
    baseline = RobustBaseline(window=50)
    for v in values:
        baseline.add(float(v))
    window = values[-50:]
    median = np.median(window)
    mad = np.median(np.abs(window - median))
    stats = baseline.threshold(factor=1.5, k=6.0)
    # statistics.median on Python floats is exact (a middle element or the mean of two), so
    # the only difference from numpy is the rounding of that one mean: well under 1e-12.
    assert stats["median"] == pytest.approx(median, rel=1e-12)
    assert stats["mad"] == pytest.approx(mad, rel=1e-12)
    assert stats["threshold"] == pytest.approx(max(1.5 * median, median + 6 * 1.4826 * mad))
    baseline.add(float("nan"))  # never enters the window
    assert len(baseline) == 50 and all(math.isfinite(x) for x in baseline.state())


def test_one_outlier_does_not_move_the_baseline() -> None:
    baseline = RobustBaseline(window=21)
    for i in range(20):
        baseline.add(2.0 + 0.01 * (i % 5))
    before = baseline.threshold(1.5, 6.0)["threshold"]
    baseline.add(1000.0)
    assert baseline.threshold(1.5, 6.0)["threshold"] == pytest.approx(before, rel=0.01)


def _suite(**kw: object) -> DetectorSuite:
    cfg = RewindConfig(enabled=True, warmup_steps=5, window=10, min_samples=3, **kw)
    return DetectorSuite(cfg)


def test_detectors_warm_up_then_fire_in_priority_order() -> None:
    suite = _suite()
    spike = StepSignals(loss=30.0, grad_norm=50.0, local_loss=30.0, fp8_saturation=0.5)
    assert suite.check(0, spike) == []  # warm-up: spike and FP8 checks are off
    nan = StepSignals(float("nan"), 1.0, float("nan"))
    assert [f.detector for f in suite.check(0, nan)] == ["non_finite"]  # always on
    for _ in range(5):
        suite.accept(StepSignals(2.0, 1.0, 2.0))
    found = suite.check(5, spike)
    assert [f.detector for f in found] == ["fp8_overflow", "loss_spike", "grad_norm_spike"]
    assert found[1].details["median"] == 2.0 and found[1].details["threshold"] == 3.0
    assert suite.check(5, StepSignals(2.9, 4.9, 2.9)) == []  # below both thresholds


def test_disabled_detectors_stay_silent() -> None:
    suite = _suite(detectors=["non_finite"])
    for _ in range(5):
        suite.accept(StepSignals(2.0, 1.0, 2.0))
    assert suite.check(10, StepSignals(30.0, 50.0, 30.0, 0.5)) == []


def test_single_process_verdict_names_rank_zero() -> None:
    suite = _suite()
    verdict = agree(suite.check(0, StepSignals(1.0, float("inf"), 1.0)), False, torch.device("cpu"))
    assert verdict.detectors == ["non_finite"] and verdict.ranks == {"non_finite": [0]}
    assert verdict.values["non_finite"]["by_rank"] == {"0": math.inf}
    assert not agree([], True, torch.device("cpu")).anomalous


def test_stable_rule_and_choice() -> None:
    targets = Targets(stable_after=4)
    for step in (0, 4, 8):
        targets.add(Target(step, step * 8, path=Path(f"step-{step}")))
    assert [t.step for t in targets.choose(9)] == [0, 4, 8]  # none stable: oldest first
    assert [t.step for t in targets.advance(9)] == [0, 4]
    assert [t.step for t in targets.items] == [4, 8]  # older stable ones are dropped
    assert [t.step for t in targets.choose(9)] == [4, 8]
    assert targets.protected == {4, 8}
    assert [t.step for t in targets.discard_after(4)] == [8]
    assert targets.stable_steps == [4]


def test_cooldown_ramps_back() -> None:
    cfg = RewindConfig(enabled=True, lr_cooldown_factor=0.5, lr_cooldown_steps=4)
    manager = RewindManager(cfg, EventLog(None), torch.device("cpu"))
    manager.cooldown = {"start": 10, "steps": 4, "factor": 0.5}
    assert [manager.lr_factor(s) for s in range(9, 16)] == [1, 0.5, 0.625, 0.75, 0.875, 1, 1]


def test_sampler_skips_ranges_and_saves_them() -> None:
    sampler = ResumableSampler(1000, seed=1, global_batch=8, micro_batch=4)
    reference = ResumableSampler(1000, seed=1, global_batch=8, micro_batch=4)
    sampler.skip(8, 24)
    sampler.skip(24, 32)  # merged with the previous range
    assert sampler.skipped == [(8, 32)]
    first = sampler.next_step()
    assert sampler.last_draws == (0, 8)
    second = sampler.next_step()
    assert sampler.last_draws == (32, 40)
    expected = [reference.next_step() for _ in range(5)]
    assert np.array_equal(first[0], expected[0][0]) and np.array_equal(second[1], expected[4][1])
    state = json.loads(json.dumps(sampler.state_dict()))
    restored = ResumableSampler(1000, seed=1, global_batch=8, micro_batch=4)
    restored.load_state_dict(state)
    assert restored.skipped == [(8, 32)] and restored.consumed == 40


def test_verify_checkpoint_reasons(kjv_data: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(kjv_data, **{"trainer.max_steps": 4})
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)
    try:
        trainer.fit()
    finally:
        trainer.close()
    folder = tmp_path / "checkpoints" / "step-00000004"
    assert verify_checkpoint(folder) is None
    shard = folder / "rank-00000.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    assert "has" in verify_checkpoint(folder) and "bytes" in verify_checkpoint(folder)
    shard.write_bytes(data[:100] + bytes(b ^ 1 for b in data[100:110]) + data[110:])
    assert "sha256" in verify_checkpoint(folder)
    shard.unlink()
    assert verify_checkpoint(folder) == "shard rank-00000.safetensors is missing"
    (folder / "manifest.json").write_text('{"format": 1, "step"')
    assert verify_checkpoint(folder).startswith("unreadable manifest")


def test_events_log_lines(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", echo=None)
    record = log.emit(
        "rewind",
        19,
        detector="loss_spike",
        detectors=["loss_spike", "grad_norm_spike"],
        ranks={"loss_spike": [0, 1]},
        values={"loss_spike": {"loss": 25.0, "median": 2.5, "mad": 0.05, "threshold": 3.75}},
        restored={"step": 12, "path": "x", "in_memory": True, "stable": True, "source": "memory"},
        skipped={"policy": "window", "draws": [[96, 160]], "steps": 8},
        lr_cooldown={"factor": 0.5, "steps": 8},
        rewinds_in_window=1,
        max_rewinds=3,
        window=500,
        nonfinite=float("nan"),
    )
    assert read_events(tmp_path) == [record] and record["nonfinite"] == "nan"
    assert console_line(record) == (
        "rewind: step 20: loss_spike (loss 25 > threshold 3.75: median 2.5, mad 0.05) on ranks "
        "0, 1 [also grad_norm_spike]; restored step 12 from memory, skipped 8 step(s) of data "
        "(window), LR x0.5 back to 1 over 8 steps [1/3 within 500 steps]"
    )


def test_snapshot_restores_model_optimizer_fp8_and_rng(kjv_data: Path, tmp_path: Path) -> None:
    from mt_train.rewind import capture, restore

    overrides = tiny_overrides(kjv_data, fp8="delayed", rewind="default")
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)
    try:
        for _ in range(2):
            trainer.train_step()
        host = capture(trainer.module, trainer.optimizer, trainer.ctx.device)
        before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
        assert any("amax_history" in k for k in before)  # delayed scaling's state is in there
        adam = {
            id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()
        }
        draw = torch.rand(3)
        for _ in range(2):
            trainer.train_step()
        restore(host, trainer.module, trainer.optimizer, trainer.ctx.device)
        for key, value in trainer.module.state_dict().items():
            assert torch.equal(value, before[key]), key
        for param, state in trainer.optimizer.state.items():
            for k, v in state.items():
                assert torch.equal(v, adam[id(param)][k]), k
        assert torch.equal(torch.rand(3), draw)  # the RNG is back where it was
        restore(host, trainer.module, trainer.optimizer, trainer.ctx.device)  # host unchanged
        trainer.train_step()
        assert all(torch.isfinite(p).all() for p in trainer.module.parameters())
    finally:
        trainer.close()


def test_stop_request_catches_sigint_once() -> None:
    import os
    import signal

    from mt_train.rewind import StopRequest

    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is before  # a second Ctrl-C interrupts at once
    assert signal.getsignal(signal.SIGINT) is before
