"""Rewind end to end by fault injection, in one process (the tiny debug model, 40 steps).

Each fault fires at step 30 after checkpoints every 4 steps with ``stable_after=4``: at the
anomaly 29 steps are done, so step-28 is not yet stable (28 + 4 > 29) and step-24 is the
newest stable checkpoint. The run must finish unattended, the events log must name the
detector and that checkpoint, and the final validation loss must be within 2% of the
fault-free run's.

Why the validation loss: after a rewind the run trains on other batches than the fault-free
run, and the training loss of a single batch of 8×64 tokens varies by 3–5% from batch to
batch at this point, so the last training loss would compare batches, not models. The
validation loss is measured on the same 8 held-out batches in both runs; skipping 6 steps
of data and cooling the LR moves it by well under 1%, a model that diverged or was not
restored by far more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from train_checks import rewind_overrides, run_rewind

from mt_train import Trainer, compose_config, to_train_config
from mt_train.checkpoint import list_checkpoints
from mt_train.rewind import RewindLimitError, read_events

FAULT_STEP = 30
STABLE = 24  # the newest stable checkpoint when step 30 fails (see the module docstring)
G = 8  # global batch
STEPS = 40  # 10 past the fault, enough for the validation-loss comparison (module docstring)


def _overrides(data: Path, **extra: object) -> list[str]:
    """``rewind_overrides`` (windows sized for a 60-step run) trained for STEPS steps."""
    return rewind_overrides(
        data, **{"trainer.max_steps": STEPS, "trainer.eval_interval": STEPS, **extra}
    )


@pytest.fixture(scope="module")
def clean(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("clean")
    result = run_rewind(_overrides(kjv_data), out)
    assert _kinds(out) == {"stable"} and result["rewinds"] == 0
    return result


def _kinds(folder: Path) -> set[str]:
    return {e["event"] for e in read_events(folder)}


def _rewinds(folder: Path) -> list[dict]:
    return [e for e in read_events(folder) if e["event"] == "rewind"]


FAULTS = {
    "nan": ({"fault.nan_at_step": FAULT_STEP}, "non_finite", "memory"),
    "nan_from_disk": (
        {"fault.nan_at_step": FAULT_STEP, "rewind.memory_snapshots": False},
        "non_finite",
        "disk",
    ),
    "spike": ({"fault.spike_at_step": FAULT_STEP}, "loss_spike", "memory"),
    # 100x: the tiny model's own gradient norm has jumped 8x above its median on one batch.
    "grad_spike": (
        {"fault.grad_spike_at_step": FAULT_STEP, "fault.spike_factor": 100.0},
        "grad_norm_spike",
        "memory",
    ),
    "fp8_overflow": (
        {"fault.fp8_overflow_at_step": FAULT_STEP, "fp8": "delayed"},
        "fp8_overflow",
        "memory",
    ),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_is_rewound(name: str, clean: dict, kjv_data: Path, tmp_path: Path) -> None:
    extra, detector, source = FAULTS[name]
    result = run_rewind(_overrides(kjv_data, **extra), tmp_path)
    assert result["steps"] == STEPS and result["rewinds"] == 1
    events = read_events(tmp_path)
    fault = [e for e in events if e["event"] == "fault"]
    assert [(e["fault"], e["at_step"]) for e in fault] == [
        (name.removesuffix("_from_disk"), FAULT_STEP)
    ]
    (rewind,) = _rewinds(tmp_path)
    assert rewind["step"] == FAULT_STEP - 1 and rewind["detector"] == detector
    assert rewind["ranks"][detector] == [0]
    assert rewind["restored"] == {
        "step": STABLE,
        "path": str(tmp_path / "checkpoints" / f"step-{STABLE:08d}"),
        "in_memory": source == "memory",
        "stable": True,
        "source": source,
    }
    # skip=window: every batch since the checkpoint, the faulty one included.
    assert rewind["skipped"] == {
        "policy": "window",
        "draws": [[STABLE * G, FAULT_STEP * G]],
        "steps": FAULT_STEP - STABLE,
    }
    assert rewind["lr_cooldown"] == {"factor": 0.5, "steps": 8}
    if detector == "fp8_overflow":
        # Inputs 10x larger than last step's amax: far more than 1% of them clip at 448.
        values = rewind["values"]["fp8_overflow"]
        assert values["saturated"] > 0.1 and values["threshold"] == 0.01
        assert values["where"].startswith("layers.")
        assert values["by_rank"] == {"0": values["saturated"]}
    assert rewind["discarded"] == [28]  # the abandoned timeline's checkpoint
    assert result["val_loss"] == pytest.approx(clean["val_loss"], rel=0.02)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [
        "step-00000036",
        "step-00000040",
    ]


def test_bad_batch_needs_data_skipping(clean: dict, kjv_data: Path, tmp_path: Path) -> None:
    bad = {"fault.bad_batch_at_step": FAULT_STEP}
    # Replaying the data meets the bad batch again after every rewind: the bound stops it.
    with pytest.raises(RewindLimitError, match=r"3 rewind\(s\) within the last 500 steps"):
        run_rewind(_overrides(kjv_data, **bad, **{"rewind.skip": "none"}), tmp_path / "none")
    events = read_events(tmp_path / "none")
    assert [e["restored"]["step"] for e in events if e["event"] == "rewind"] == [STABLE] * 3
    (give_up,) = [e for e in events if e["event"] == "give_up"]
    assert give_up["detector"] == "loss_spike" and len(give_up["history"]) == 3

    # Skipping only the batches that tripped the detector gets past it, once.
    result = run_rewind(
        _overrides(kjv_data, **bad, **{"rewind.skip": "batches"}), tmp_path / "batches"
    )
    assert result["steps"] == STEPS and result["rewinds"] == 1
    (rewind,) = _rewinds(tmp_path / "batches")
    assert rewind["detector"] == "loss_spike" and rewind["restored"]["step"] == STABLE
    assert rewind["skipped"] == {
        "policy": "batches",
        "draws": [[(FAULT_STEP - 1) * G, FAULT_STEP * G]],
        "steps": 1,
    }
    assert result["val_loss"] == pytest.approx(clean["val_loss"], rel=0.02)


def test_give_up_report_from_the_cli(kjv_data: Path, tmp_path: Path, capsys) -> None:
    from mt_train.cli import main

    overrides = rewind_overrides(
        kjv_data,
        **{
            "fault.bad_batch_at_step": FAULT_STEP,
            "rewind.skip": "none",
            "rewind.max_rewinds": 1,
            "trainer.output_dir": tmp_path,
            "hydra.run.dir": tmp_path,
        },
    )
    assert main(overrides) == 3
    err = capsys.readouterr().err
    assert "mt-train: stopped: rewind: stopped at step 30: loss_spike" in err
    assert "rewind.skip=none replays the same data" in err and "Traceback" not in err


@pytest.mark.parametrize(("at", "stable"), [(6, True), (3, False)])
def test_early_nan_goes_back_to_the_start(
    at: int, stable: bool, kjv_data: Path, tmp_path: Path
) -> None:
    # At step 6, step-4 is one healthy step old (not stable) while the start state is 5 steps
    # old (stable): rewind takes the start state, held in memory. At step 3 nothing is stable
    # yet: rewind takes the oldest target held, the start state, and says it was not stable.
    # The run goes on unattended past the rewind and its LR cool-down to the end of 16 steps.
    short = {"trainer.max_steps": 16, "trainer.eval_interval": 16}
    result = run_rewind(rewind_overrides(kjv_data, **{"fault.nan_at_step": at, **short}), tmp_path)
    assert result["steps"] == 16
    (rewind,) = _rewinds(tmp_path)
    assert rewind["restored"] == {
        "step": 0,
        "path": None,
        "in_memory": True,
        "stable": stable,
        "source": "memory",
    }


def test_rewind_off_stops_on_nan(kjv_data: Path, tmp_path: Path) -> None:
    overrides = rewind_overrides(kjv_data, rewind="disabled", **{"fault.nan_at_step": 3})
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)
    try:
        with pytest.raises(FloatingPointError, match="stopped at step 3: non_finite") as err:
            trainer.fit()
    finally:
        trainer.close()
    assert "rewind=default would have restored" in str(err.value)
    (give_up,) = [e for e in read_events(tmp_path) if e["event"] == "give_up"]
    assert give_up["step"] == 2 and give_up["detector"] == "non_finite"


def test_no_false_alarms_in_300_clean_steps(kjv_data: Path, tmp_path: Path) -> None:
    """rewind=default exactly as shipped (warm-up 50, window 50, thresholds), 300 steps."""
    from train_checks import tiny_overrides

    overrides = tiny_overrides(
        kjv_data,
        rewind="default",
        **{
            "trainer.max_steps": 300,
            "trainer.eval_interval": 300,
            "trainer.checkpoint_interval": 50,
            "trainer.log_interval": 50,
            # The global batch of 8 in one micro-batch, not two: the same losses and gradient
            # norms to fp32 rounding (what the detectors watch), with half the passes per step.
            "trainer.micro_batch_size": 8,
        },
    )
    result = run_rewind(overrides, tmp_path)
    assert result["steps"] == 300 and result["rewinds"] == 0
    # Only the stable rule speaks: the start state and checkpoints 50..250 (300 is too new).
    events = read_events(tmp_path)
    assert [(e["event"], e["checkpoint"]) for e in events] == [
        ("stable", s) for s in (0, 50, 100, 150, 200, 250)
    ]
