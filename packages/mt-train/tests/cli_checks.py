"""Helpers of the reliability tests: a small prepared data folder and ``mt-train`` runs, in this
process (``run_cli``: the console entry point with pytest's capture) or as a subprocess
(``run_subprocess``: for SIGKILLs), with their exit status and stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_checks import tiny_overrides

from mt_train.cli import main
from mt_train.data import ByteTokenizer, write_prepared


def small_data(folder: Path) -> Path:
    """A byte-token folder of 20 short documents (every 4th one validation): ~8.8k training
    and ~2.9k validation tokens, enough for the tiny model's 64-token windows."""
    docs = [f"In the beginning {i} was the word. " * 9 for i in range(20)]
    write_prepared(folder, docs, ByteTokenizer(), val_every=4)
    return folder


def run_overrides(data: Path, out: Path, **extra: object) -> list[str]:
    """The tiny job writing to ``out`` (Hydra's folder and the trainer's)."""
    return tiny_overrides(
        data, **{"hydra.run.dir": str(out), "trainer.output_dir": str(out), **extra}
    )


def run_cli(capsys: pytest.CaptureFixture, args: list[str]) -> tuple[int, str]:
    """``mt-train args`` in this process: exit status and stderr."""
    capsys.readouterr()
    status = main(args)
    return status, capsys.readouterr().err


def run_subprocess(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m mt_train args`` with one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mt_train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_error_line(status: int, err: str, expected: str, tool: str = "mt-train") -> None:
    """Exit status 2, no traceback, and stderr's last line is the one ``<tool>: error:`` line
    holding ``expected``."""
    assert status == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith(f"{tool}: error: ")]
    assert errors == [lines[-1]], err[-3000:]
    assert expected in lines[-1], lines[-1]


def start_error(overrides: list[str], output_dir: str | Path) -> tuple[str, str]:
    """Build a trainer on this rank; the kind and message of the error it stops with (for
    spawned ranks, so module level)."""
    from mt_train import Trainer, compose_config, to_train_config
    from mt_train.errors import UserError

    try:
        trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=output_dir)
    except UserError as err:
        return type(err).__name__, str(err)
    trainer.close()
    return "", ""
