"""Helpers of the reliability tests: a small prepared data folder and ``mt-train`` runs, in this
process (``run_cli``: the console entry point with pytest's capture) or in a process of their
own (``run_forked``: for runs that end their process, by a SIGKILL, the watchdog's exit or a
collective timeout), with their exit status and output.

A process of its own is forked from the fork server of the gloo pools (``mt_comm.testing``),
which has imported torch, mt_parallel and mt_train: it starts in a fraction of a second where
``python -m mt_train`` pays those imports (seconds). It runs what ``python -m mt_train`` runs,
``mt_train.cli.main``, with file descriptors 1 and 2 sent to files, and ends with its status
(or the signal that killed it) as a subprocess would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from train_checks import tiny_overrides

import mt_comm.testing
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


def mt_train_main(args: list[str]) -> int:
    """What ``python -m mt_train args`` runs (a target for :class:`Forked`)."""
    sys.argv = ["mt-train"]
    return main(args)


def _forked(
    target: Callable[..., Any], args: tuple, environ: dict[str, str], cwd: str, out: str, err: str
) -> None:
    """The forked process: the given environment and folder, output to files, then ``target``."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY)
        os.dup2(opened, fd)
        os.close(opened)
    # Line-buffered: a process that ends with os._exit (the watchdog) loses no printed line.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    torch.set_num_threads(1)
    sys.exit(target(*args))


class Forked:
    """A process forked from the pools' fork server running ``target(*args)``."""

    def __init__(
        self,
        target: Callable[..., Any],
        *args: Any,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(list(mt_comm.testing.PRELOAD))  # if it is not running yet
        self._folder = tempfile.TemporaryDirectory()
        self._out = os.path.join(self._folder.name, "stdout")
        self._err = os.path.join(self._folder.name, "stderr")
        for path in (self._out, self._err):  # there even if the process dies before it writes
            Path(path).touch()
        environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.process = context.Process(
            target=_forked,
            args=(target, args, environ, str(cwd or os.getcwd()), self._out, self._err),
            daemon=True,
        )
        self.process.start()

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Its exit status (minus the number of the signal that killed it) and output, as
        ``subprocess.run`` gives them; on a timeout the process is killed and ``TimeoutError``
        raised."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
            raise TimeoutError(f"forked {self.process.name} still running after {timeout} s")
        try:
            out, err = (Path(p).read_text(errors="replace") for p in (self._out, self._err))
        finally:
            self._folder.cleanup()
        return subprocess.CompletedProcess([], self.process.exitcode, out, err)


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a one-machine world (for :class:`Forked`)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_forked(
    args: list[str], timeout: float = 300, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    """``mt-train args`` in a forked process of its own with one thread (module docstring)."""
    return Forked(mt_train_main, args, cwd=cwd).wait(timeout)


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
