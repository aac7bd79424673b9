"""Every config file composes and validates; bad overrides end in one clear error line."""

from __future__ import annotations

import shlex
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from mt_train import compose_config, to_train_config
from mt_train.cli import main, print_summary
from mt_train.models import model_sizes
from mt_train.summary import TrainSummary

CONF = Path(str(resources.files("mt_train") / "conf"))
# The model group's options are the registered families' named sizes; the others are YAML files.
GROUP_FILES = sorted(
    [
        (group.name, path.stem)
        for group in CONF.iterdir()
        if group.is_dir() and not group.name.startswith("_")
        for path in group.glob("*.yaml")
    ]
    + [("model", name) for name in model_sizes()]
)


def test_every_group_has_configs() -> None:
    groups = {g for g, _ in GROUP_FILES}
    assert groups >= {
        "model", "parallel", "fp8", "optimizer", "scheduler", "data",
        "checkpoint", "rewind", "fault", "logging", "experiment",
    }  # fmt: skip


@pytest.mark.parametrize(("group", "name"), GROUP_FILES, ids=[f"{g}={n}" for g, n in GROUP_FILES])
def test_config_file_composes_and_validates(group: str, name: str) -> None:
    cfg = to_train_config(compose_config([f"{group}={name}"]))
    if group == "model":
        assert cfg.model.name == name
    if group == "experiment":
        header = (CONF / group / f"{name}.yaml").read_text().splitlines()
        assert header[0] == "# @package _global_"
        assert any(line.startswith("# Launch: ") for line in header[:5]), "launch command header"


def test_default_config_values() -> None:
    cfg = to_train_config(compose_config())
    assert cfg.model.name == "debug" and cfg.data.path is None and cfg.fp8.recipe == "none"
    assert cfg.parallel.tp == 1 and cfg.checkpoint.resume == "none"
    assert cfg.model.dropout == 0.0 and cfg.data.document_masking is False


def test_sharded_and_context_parallel_layouts_validate() -> None:
    cfg = to_train_config(compose_config(["parallel=cp2", "parallel.data_parallel=fsdp"]))
    assert cfg.check_world(4) == 2  # dp = 4 / cp
    cfg = to_train_config(compose_config(["parallel=zero1", "fp8=tensorwise", "parallel.tp=2"]))
    assert cfg.parallel.data_parallel == "zero1" and cfg.check_world(2) == 1


def test_mxfp8_scale_rounding_is_an_override() -> None:
    assert dict(to_train_config(compose_config(["fp8=mxfp8"])).fp8.recipe_args) == {
        "scale_rounding": "ceil"
    }
    cfg = to_train_config(compose_config(["fp8=mxfp8", "fp8.recipe_args.scale_rounding=floor"]))
    assert dict(cfg.fp8.recipe_args) == {"scale_rounding": "floor"}


def test_issue_example_overrides_compose() -> None:
    cfg = to_train_config(
        compose_config(
            ["model=llama3_8b", "parallel.tp=2", "fp8=blockwise", "trainer.max_steps=100",
             "optimizer.lr=3e-4"]
        )
    )  # fmt: skip
    assert (cfg.model.dim, cfg.parallel.tp, cfg.fp8.recipe, cfg.optimizer.lr) == (
        4096, 2, "block", 3e-4,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.not_a_key=1", "trainer.not_a_key"),
        ("parallel.tp=3", "tp=3 does not divide num_heads=4"),
        ("data.path=/no/such/folder", "data.path='/no/such/folder' is not a folder"),
        (
            "model=gpt5",
            "no config 'model=gpt5'; valid: debug, deepseek_moe_tiny, deepseek_v2_lite, deepseek_v3_671b",
        ),
        ("trainer.max_steps=many", "Value 'many' of type 'str' could not be converted to Integer"),
        ("fp8.recipe=fp4", "fp8.recipe='fp4' is unknown; valid: none, delayed"),
        (
            "fp8=rowwise fp8.expert_formats=e5m2",
            "fp8.expert_formats='e5m2' is unknown; valid: auto, e4m3, recipe",
        ),
        (
            "fp8=mxfp8 fp8.recipe_args.scale_rounding=up",
            "MXFP8Scaling.scale_rounding must be 'ceil' or 'floor', got 'up'",
        ),
        (
            "scheduler.name=linear",
            "scheduler.name='linear' is unknown; valid: cosine, wsd, constant",
        ),
        ("rewind.skip=sometimes", "rewind.skip='sometimes' is unknown; valid: window, batches"),
        ("rewind.detectors=[nan]", "rewind.detectors has unknown ['nan']; valid: non_finite,"),
        ("rewind.loss_spike_factor=0.5", "rewind.loss_spike_factor must be > 1, got 0.5"),
        ("rewind.min_samples=80", "rewind.min_samples=80 exceeds rewind.window=50"),
        ("rewind.fp8_saturation=2", "rewind.fp8_saturation must be in (0, 1), got 2.0"),
        ("fault.nan_at_step=0", "fault.nan_at_step must be an integer >= 1, got 0"),
        ("fault.rank=3", "fault.rank=3 is not a rank of this run (world size 1)"),
        ("model.dropout=1.5", "model.dropout must be in [0, 1), got 1.5"),
        (
            "optimizer.impl=adam8bit",
            "optimizer.impl='adam8bit' is unknown; valid: auto, triton, fused, foreach",
        ),
        ("optimizer.impl=triton", "optimizer.impl=triton needs CUDA parameters, Triton installed"),
        ("parallel=cp2", "world size 1 is not divisible by tp·cp·pp = 1·2·1 = 2"),
        ("parallel.pp=2 parallel.pp_layers=[1,1]", "pp_layers=[1, 1] sums to 2, the model has 4"),
        ("parallel.pp=8", "4 layers cannot be split into 8 pipeline chunks"),
        ("parallel.pp=2 parallel.pp_chunks=2", "1f1b holds exactly 1 chunk(s) per rank"),
        ("parallel.pp=4 parallel.pp_microbatches=2", "needs at least 4 micro-batches per step"),
        ("parallel.pp=2 parallel.pp_schedule=zb", "pp_schedule='zb'; valid: gpipe, 1f1b"),
        ("parallel=cp2 trainer.seq_len=250", "needs the sequence length 250 to be divisible by"),
        (
            "data.document_masking_kernel=fused",
            "data.document_masking_kernel='fused' is unknown; valid: auto, flex, explicit",
        ),
        (
            "parallel=cp2 parallel.cp_attention=ring data.document_masking=true "
            "data.document_masking_kernel=flex",
            "data.document_masking_kernel=flex does not run inside ring attention "
            "(parallel.cp=2, parallel.cp_attention=ring): use parallel.cp_attention=all_gather",
        ),
        (
            "data.document_masking=true data.document_masking_kernel=flex model.dropout=0.1",
            "data.document_masking_kernel=flex has no attention dropout (model.dropout=0.1)",
        ),
        (
            "data.document_masking=true data.document_masking_kernel=flex",
            "data.document_masking_kernel=flex needs a GPU (torch's FlexAttention has no backward",
        ),
        (
            "parallel=cp2 parallel.cp_attention=ring model.dropout=0.1",
            "parallel.cp_attention=ring with model.dropout=0.1: ring attention has no attention "
            "dropout; use parallel.cp_attention=all_gather or model.dropout=0",
        ),
    ],
)
def test_bad_override_is_one_line(
    override: str, expected: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(override.split()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mt-train: error: "), err
    assert expected in err, err


def test_console_entry_reports_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mt_train", "parallel.tp=3"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "mt-train: error: tensor parallel size tp=3 does not divide num_heads=4"
    ]
    assert "Traceback" not in proc.stderr + proc.stdout


README = Path(__file__).parents[1] / "README.md"


def _readme_rewind_commands() -> list[list[str]]:
    text = README.read_text().split("## Rewind", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("mt-train ")]
    return [shlex.split(line, comments=True)[1:] for line in lines]


@pytest.mark.parametrize("args", _readme_rewind_commands(), ids=lambda a: " ".join(a)[-60:])
def test_readme_rewind_commands_compose(args: list[str]) -> None:
    # The drills themselves run in test_train_rewind*.py on the tiny model; here every command
    # in the README's Rewind section must at least pass the CLI's validation as written.
    overrides = [a for a in args if not a.startswith("hydra.")]
    cfg = to_train_config(compose_config(overrides))
    assert cfg.rewind.enabled


def _summary(**fields: object) -> TrainSummary:
    base = dict(
        steps=82, train_loss=2.1225, val_loss=float("nan"), wall_s=40.0, tokens_per_s=8000.0,
        output_dir="/tmp/run", checkpoint=None, losses=[], rewinds=0, sample="", stopped="SIGTERM",
    )  # fmt: skip
    base.update(fields)
    return TrainSummary(**base)  # type: ignore[arg-type]


def test_summary_of_a_run_stopped_before_evaluating_or_checkpointing(capsys) -> None:
    print_summary(_summary())
    out = capsys.readouterr().out
    assert "validation loss nan" not in out and "no validation (the run stopped" in out
    assert "no checkpoint was written, so a new run starts from step 0" in out
    assert "checkpoint.resume=auto" not in out


def test_summary_of_a_preempted_run_with_a_checkpoint(capsys) -> None:
    print_summary(_summary(val_loss=1.5, checkpoint="/tmp/run/checkpoints/step-00000082"))
    out = capsys.readouterr().out
    assert "validation loss 1.5000" in out
    assert "stopped early by SIGTERM after step 82; continue with checkpoint.resume=auto" in out
