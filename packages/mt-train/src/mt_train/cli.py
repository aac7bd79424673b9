"""``mt-train``: the Hydra entry point (thin: the work is in :class:`mt_train.trainer.Trainer`).

Observability: an out-of-memory error prints one line (with the memory snapshot it wrote when
``profiling.memory_snapshot`` is on) and exits 1; a collective timeout prints one line naming
the rank and the collective (:func:`mt_train.watchdog.collective_timeout_message`) and exits 5;
a step outliving ``trainer.step_timeout_s`` exits 4 from the watchdog thread. At the end rank
0 prints a summary: steps, tokens, mean and best tokens/s and MFU, peak memory, checkpoints
written, rewinds, and the profiler's files.

Before Hydra runs, the command line's overrides are composed and validated once, so a bad
override (unknown key, a key added with ``+`` that no schema has, wrong type, tp not dividing
the heads, a missing data folder, a device that is not there, a run folder that cannot be
written) ends with one ``mt-train: error: ...`` line and exit status 2 instead of a
traceback. Inside Hydra's job the same holds for every :class:`~mt_train.errors.UserError`
the trainer raises (a bad data folder, a checkpoint of another model, a locked run folder, a
full disk): Hydra would print a traceback, so the job function catches them. Under
torchrun, ranks other than 0 run with Hydra's run folder and logs switched off; the trainer
uses rank 0's run folder on every rank. When rewind gives up, or a non-finite step stops a
run with rewind off, the report is printed (no traceback) and the exit status is 3; a run
stopped by SIGTERM/SIGINT exits 0 after its checkpoint is on disk.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict

from mt_core import get_device
from mt_train import loggers
from mt_train.config.store import compose_config, register_configs, to_train_config
from mt_train.errors import EXIT_USER_ERROR, RankZeroError, UserError, check_writable, report
from mt_train.optim import optimizer_impl
from mt_train.profiling import MEMORY_VIZ, check_memory_snapshot
from mt_train.rewind.manager import RewindLimitError
from mt_train.summary import TrainSummary
from mt_train.trainer import Trainer
from mt_train.watchdog import (
    EXIT_COLLECTIVE_TIMEOUT,
    collective_timeout_message,
    dump_flight_recorder,
    is_collective_timeout,
)

EXIT_REWIND_LIMIT = 3
"""Exit status when rewind gave up (too many rewinds, or nothing to rewind to)."""
EXIT_OUT_OF_MEMORY = 1
"""Exit status after an out-of-memory error."""
_exit_status = 0

QUIET_RANK_OVERRIDES = (
    "hydra.run.dir=.",
    "hydra.output_subdir=null",
    "hydra/job_logging=disabled",
    "hydra/hydra_logging=disabled",
)


def one_line(err: BaseException) -> str:
    """A single line naming what was wrong and, where known, what is valid."""
    if isinstance(err, MissingConfigException) and err.options:
        group = (err.missing_cfg_file or "").rsplit("/", 1)
        name = f"{group[0]}={group[-1]}" if len(group) == 2 else err.missing_cfg_file
        return f"no config {name!r}; valid: {', '.join(sorted(err.options))}"
    if isinstance(err, KeyError) and err.args:
        return str(err.args[0])
    parts = [str(err)]
    if err.__cause__ is not None:
        parts.append(str(err.__cause__).split("\n")[0])
    text = ": ".join(p.strip() for p in parts if p.strip())
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Keys of a composed config that no schema declares (added with ``+key=value``): every
    node typed by a dataclass may hold only that dataclass's fields (``hydra`` is Hydra's)."""
    node_type = OmegaConf.get_type(cfg)
    fields = getattr(node_type, "__dataclass_fields__", None)
    found = []
    for key in cfg:
        if not prefix and key == "hydra":
            continue
        path = f"{prefix}{key}"
        if fields is not None and key not in fields:
            found.append(path)
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            found += unknown_keys(child, f"{path}.")
    return found


def run_folders(cfg: DictConfig) -> list[tuple[str, str]]:
    """The folders this run writes before the trainer can check them (Hydra's run folder and
    its log), with what they are."""
    folders = [(str(cfg.hydra.run.dir), "the run folder (hydra.run.dir)")]
    if cfg.trainer.output_dir:
        folders.append((str(cfg.trainer.output_dir), "the run folder (trainer.output_dir)"))
    return folders


def validate_overrides(argv: Sequence[str]) -> str | None:
    """Compose and validate the overrides in ``argv``; the error line, or None if all is well."""
    overrides = [a for a in argv if not a.startswith("-") and ("=" in a or a.startswith("~"))]
    try:
        composed = compose_config(overrides, with_hydra=True)
        unknown = sorted(unknown_keys(composed))
        if unknown:
            return (
                f"unknown config key(s) {', '.join(unknown)}; `mt-train --cfg job` lists every "
                "key (a misspelt group or key added with +key=value is never read)"
            )
        folders = run_folders(composed)
        with open_dict(composed):
            del composed["hydra"]
        cfg = to_train_config(composed)
        cfg.check_world(int(os.environ.get("WORLD_SIZE", "1")))
        # An unknown or absent device is a config error too, as is a kernel it cannot run.
        device = get_device(cfg.trainer.device)
        check_memory_snapshot(cfg.profiling, device.type)
        loggers.enabled_loggers(cfg.logging)
        optimizer_impl(cfg.optimizer.impl, device.type, cfg.parallel.data_parallel)
        if int(os.environ.get("RANK", "0")) == 0:
            for folder, what in folders:
                check_writable(folder, what)
    except Exception as err:  # every failure here is a config error: report it in one line
        return one_line(err)
    return None


def print_summary(summary: TrainSummary) -> None:
    validation = (
        "no validation (the run stopped before its first evaluation)"
        if math.isnan(summary.val_loss)
        else f"validation loss {summary.val_loss:.4f}"
    )
    mfu = (
        f", MFU {summary.mfu:.1%} (best {summary.best_mfu or 0:.1%})"
        if summary.mfu is not None
        else ""
    )
    lines = [
        f"done: {summary.steps} steps, {summary.tokens:,} tokens in {summary.wall_s:.0f} s; "
        f"final train loss {summary.train_loss:.4f}, {validation}",
        f"throughput: {summary.tokens_per_s:,.0f} tokens/s (best interval "
        f"{summary.best_tokens_per_s:,.0f}){mfu}; peak memory {summary.peak_memory_gib:.2f} GiB",
        f"outputs: {summary.output_dir} (metrics.jsonl"
        + (f", checkpoint {summary.checkpoint}" if summary.checkpoint else "")
        + f"); checkpoints written: {summary.checkpoints_written}; rewinds: {summary.rewinds}"
        + (" (see events.jsonl)" if summary.rewinds else ""),
    ]
    if summary.traces:
        lines.append("profiles: " + ", ".join(summary.traces))
    if summary.stopped:
        resume = (
            "continue with checkpoint.resume=auto and the same hydra.run.dir"
            if summary.checkpoint
            else "no checkpoint was written, so a new run starts from step 0"
        )
        lines.append(f"stopped early by {summary.stopped} after step {summary.steps}; {resume}")
    if summary.sample:
        lines.append("greedy sample:\n" + "\n".join("  " + s for s in summary.sample.splitlines()))
    print("\n".join(lines), flush=True)


@hydra.main(version_base="1.3", config_path="pkg://mt_train.conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    global _exit_status
    try:
        _train(cfg)
    except RankZeroError:  # rank 0 stopped on it and reports it
        _exit_status = EXIT_USER_ERROR
    except UserError as err:  # Hydra would print a traceback: one line instead
        rank = int(os.environ.get("RANK", "0"))
        _exit_status = report("mt-train", f"rank {rank}: {err}" if rank else err)


def _train(cfg: DictConfig) -> None:
    train_cfg = to_train_config(cfg)
    trainer = Trainer(
        train_cfg, output_dir=train_cfg.trainer.output_dir or HydraConfig.get().runtime.output_dir
    )
    global _exit_status
    try:
        summary = trainer.fit()
    except RewindLimitError as err:  # a clear report instead of a traceback
        if trainer.rank == 0:
            print(f"mt-train: stopped: {err}", file=sys.stderr, flush=True)
        _exit_status = EXIT_REWIND_LIMIT
        return
    except torch.OutOfMemoryError:
        snapshot = trainer.observer.profiler.oom_snapshot()
        where = (
            f"memory snapshot in {snapshot} (drag it into {MEMORY_VIZ})"
            if snapshot is not None
            else "profiling.memory_snapshot=true profiling.steps=[1,1] records a snapshot of it"
        )
        print(
            f"mt-train: rank {trainer.rank}: out of memory at step {trainer.step + 1}; {where}",
            file=sys.stderr,
            flush=True,
        )
        _exit_status = EXIT_OUT_OF_MEMORY
        return
    except RuntimeError as err:
        recorded = (
            dump_flight_recorder(trainer.output_dir, trainer.rank)
            if train_cfg.comm.trace_buffer_size > 0 and is_collective_timeout(err)
            else None
        )
        message = collective_timeout_message(err, trainer.rank, train_cfg.comm.timeout_s, recorded)
        if message is None:
            raise
        print(f"mt-train: {message}", file=sys.stderr, flush=True)
        _exit_status = EXIT_COLLECTIVE_TIMEOUT
        return
    finally:
        trainer.close()
    if trainer.rank == 0:
        print_summary(summary)


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    if not any(a in ("-m", "--multirun", "-h", "--help", "--hydra-help") for a in args):
        error = validate_overrides(args)
        if error is not None:
            print(f"mt-train: error: {error}", file=sys.stderr)
            return 2
    if int(os.environ.get("RANK", "0")) != 0:
        args += QUIET_RANK_OVERRIDES
    sys.argv = [sys.argv[0] if sys.argv else "mt-train", *args]
    global _exit_status
    _exit_status = 0
    _hydra_main()
    return _exit_status
