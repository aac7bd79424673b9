"""A run's state on disk and in memory: save, load (resume), and rewind to a stable target.

The state (parameters, optimizer state — this rank's pieces under FSDP2 / ZeRO-1 —, FP8
scaling state, sampler position and skipped ranges, step, RNG generators and tracker, the
rewind policy's baselines and cool-down) is written by :meth:`RunState.save` as one
checkpoint (:mod:`mt_train.checkpoint`) whose manifest also records the model config and its
family. :meth:`RunState.load` restores any layout (RNG states only into the layout that saved
them; elsewhere the caller re-seeds). With rewind on, each save is also a rewind target,
held in memory with ``rewind.memory_snapshots``; :meth:`RunState.rewind` goes back to the
newest stable one and skips data (:mod:`mt_train.rewind.manager` decides, this applies).

A checkpoint that cannot be loaded into this run (another model shape or family, another
data seed, not a checkpoint, a corrupt shard) stops the run before training with a
:class:`~mt_train.errors.CheckpointError` naming the folder, what differs and, for the model,
the config fields in which the checkpoint's model differs from this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch import nn

from mt_train import ranks
from mt_train.checkpoint.checkpointer import Checkpointer, TPLayout, load_into, shard_tensors
from mt_train.checkpoint.files import CheckpointReader, checkpoint_folder, discard, step_dir
from mt_train.checkpoint.state import StateLayout, live_state
from mt_train.config.schema import ModelConfig, TrainConfig
from mt_train.data.blend import data_order_change
from mt_train.data.dataset import ResumableSampler
from mt_train.errors import CheckpointError, DiskError
from mt_train.models.registry import family_of
from mt_train.optim import Zero1AdamW
from mt_train.ranks import all_gather_str
from mt_train.rewind import snapshot as snap
from mt_train.rewind.consensus import Verdict
from mt_train.rewind.events import EventLog
from mt_train.rewind.faults import FaultInjector
from mt_train.rewind.manager import RewindManager
from mt_train.rewind.recovery import Recovery


class RunState:
    """Saves, loads and rewinds one rank's training state (module docstring)."""

    def __init__(
        self,
        cfg: TrainConfig,
        model_cfg: ModelConfig,
        module: nn.Module,
        optimizer: Any,
        sampler: ResumableSampler,
        guard: RewindManager,
        events: EventLog,
        ckpt_dir: Path,
        run_id: str,
        ranks: tuple[int, int, int],
        layout: dict[str, int],
        device: Any,
        tp_layout: TPLayout,
        data_meta: dict[str, Any],
        pp_group: Any = None,
    ) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        self.module, self.optimizer, self.sampler = module, optimizer, sampler
        self.guard, self.events, self.ckpt_dir = guard, events, ckpt_dir
        self.rank, self.world_size, self.dp_cp_rank = ranks
        self.layout, self.device, self.tp_layout = layout, device, tp_layout
        self.data_meta = data_meta
        self.state_layout = StateLayout.of(module, optimizer)
        if pp_group is not None:  # rank 0's manifest lists the pieces of every stage
            for shapes in all_gather_str(
                json.dumps(self.state_layout.shapes), device.torch_device(), pp_group
            ):
                self.state_layout.shapes.update(json.loads(shapes))
        ck = cfg.checkpoint
        self.checkpointer = Checkpointer(
            ckpt_dir, self.rank, self.world_size, run_id, ck.keep_last, ck.async_save
        )
        self.recovery = Recovery(ckpt_dir, self.rank, device.torch_device(), events)
        self.last_save: int | None = None
        self.resumed_from: Path | None = None

    def start(self, faults: FaultInjector, reseed: Callable[[int], None]) -> int:
        """Open the checkpoint folder and resume (``checkpoint.resume``) or load the weights of
        ``checkpoint.init_from``; returns the step the run starts at. A drill's corruption of
        the newest checkpoint happens first, so resuming must survive it."""
        try:
            return self._start(faults, reseed)
        except OSError as err:  # a read-only or full checkpoint folder
            raise DiskError("the checkpoint folder", err.filename or self.ckpt_dir, err) from err

    def _start(self, faults: FaultInjector, reseed: Callable[[int], None]) -> int:
        ck = self.cfg.checkpoint
        faults.corrupt_at_start(self.ckpt_dir)
        self.checkpointer.restore_replaced()
        ranks.barrier()
        step = 0
        resume = self.recovery.find_resume(ck.resume)
        if resume is not None:
            step = self.load(resume, reseed)
        elif ck.init_from is not None:
            root = Path(ck.init_from).expanduser()
            try:
                folder = checkpoint_folder(root)
            except FileNotFoundError as err:
                raise CheckpointError(f"checkpoint.init_from: {err}") from None
            self.init_from(folder)
        ranks.barrier()
        if ck.enabled or self.cfg.rewind.enabled:
            self.checkpointer.prepare()
        return step

    def init_from(self, folder: Path) -> None:
        """Load only the model weights of a checkpoint (``checkpoint.init_from``)."""
        with self._loading("checkpoint.init_from", folder) as reader:
            load_into(reader, self.module, None, self.state_layout, self.tp_layout, self.device)
        if isinstance(self.optimizer, Zero1AdamW):  # its fp32 master shard follows the weights
            self.optimizer.sync_master()

    @contextlib.contextmanager
    def _loading(self, option: str, folder: Path) -> Iterator[CheckpointReader]:
        """A reader of ``folder``; what fails while loading it becomes a
        :class:`CheckpointError` naming the folder and the model config fields that differ."""
        try:
            reader = CheckpointReader(folder)
            yield reader
        except (KeyError, ValueError, FileNotFoundError) as err:
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            raise CheckpointError(
                f"{option}: {folder} cannot be loaded into this run: {message}"
                + model_differences(folder, self.model_cfg)
            ) from None

    def load(self, folder: Path, reseed: Callable[[int], None]) -> int:
        """Restore a checkpoint (any layout); returns its step. RNG states come back only into
        the layout that saved them; at another layout ``reseed(seed + step)`` re-seeds."""
        with self._loading("resume", folder) as reader:
            manifest = reader.manifest
            saved = {"world_size": manifest["world_size"], **manifest["parallel"]}
            same = all(saved.get(k) == v for k, v in self.layout.items())
            self.sampler.load_state_dict(manifest["data"])
            change = data_order_change(manifest["data"], self.sampler)
            if change and self.rank == 0:
                print(f"mt-train: warning: {change}", file=sys.stderr, flush=True)
            load_into(
                reader, self.module, self.optimizer, self.state_layout, self.tp_layout,
                self.device, self.rank if same else None,
            )  # fmt: skip
        step = int(manifest["step"])
        if not same:
            reseed(self.cfg.trainer.seed + step)
        snap.after_load(self.module)
        self.guard.load_state_dict(manifest.get("rewind", {}))
        self.recovery.load_decisions(self.sampler, self.guard)
        self.resumed_from = folder
        self.events.emit("resume", step, path=str(folder))
        return step

    def save(self, step: int) -> None:
        """Checkpoint ``step``; with rewind on it also becomes a rewind target (held in memory
        too with ``rewind.memory_snapshots``)."""
        rw = self.cfg.rewind
        hold = rw.enabled and rw.memory_snapshots
        local = (
            snap.capture(self.module, self.optimizer, self.device)
            if hold
            else live_state(self.module, self.optimizer, self.device)
        )
        tensors = shard_tensors(
            local, self.state_layout, self.tp_layout, self.rank, self.dp_cp_rank
        )
        manifest = {
            "step": step,
            "config": dataclasses.asdict(self.cfg),
            "model": dataclasses.asdict(self.model_cfg),
            "model_family": family_of(self.model_cfg).name,
            "data": self.sampler.state_dict(),
            "world_size": self.world_size,
            "parallel": {**dataclasses.asdict(self.cfg.parallel), "dp": self.layout["dp"]},
            "tp_plan": self.tp_layout.plan,
            "sharded_shapes": self.state_layout.shapes,
            "rewind": self.guard.state_dict(),
            "fp8_state": sorted(k for k in self.module.state_dict() if "fp8" in k.lower()),
            "tokenizer": self.data_meta,
        }
        protect = frozenset(self.guard.targets.protected | {step})
        self.checkpointer.save(step, tensors, manifest, copy=not hold, protect=protect)
        self.last_save = step
        self.guard.add_target(
            snap.Target(
                step,
                self.sampler.consumed,
                path=step_dir(self.ckpt_dir, step),
                host=local if hold else None,
            )
        )

    def start_targets(self, step: int) -> None:
        """Rewind targets a fit starts with: its starting state, and after a resume the
        older checkpoints that manifest knew to be stable."""
        rw = self.cfg.rewind
        if not rw.enabled or self.guard.targets.items:
            return
        if self.resumed_from is not None:
            manifest = CheckpointReader(self.resumed_from).manifest
            for older in manifest.get("rewind", {}).get("stable", []):
                folder = step_dir(self.ckpt_dir, older)
                if older < step and (folder / "manifest.json").is_file():
                    self.guard.add_target(snap.Target(older, -1, path=folder, stable=True))
        host = (
            snap.capture(self.module, self.optimizer, self.device) if rw.memory_snapshots else None
        )
        self.guard.add_target(
            snap.Target(step, self.sampler.consumed, path=self.resumed_from, host=host)
        )

    def rewind(self, anomaly_at: int, verdict: Verdict) -> int:
        """Go back to the newest stable target and skip data; returns the step rewound to."""
        self.checkpointer.wait()
        draws = self.sampler.last_draws
        for target in self.guard.plan(anomaly_at, verdict):
            source = self._restore(target)
            if source is not None:
                break
        else:
            raise self.guard.give_up(anomaly_at, verdict, "no readable checkpoint to rewind to")
        skipped = self.guard.skip_range(target, draws)
        self.sampler.consumed = target.consumed
        if skipped is not None:
            self.sampler.skip(*skipped)
        # The restored state is on disk already (if the target has a folder); what the rewind
        # decided goes to the decisions file below, so a stop right now need not save again.
        self.last_save = target.step if target.path is not None else None
        dropped = self.guard.commit(
            anomaly_at, verdict, target, source, skipped, self.cfg.trainer.global_batch_size
        )
        if self.rank == 0:
            discard(self.ckpt_dir, [t.step for t in dropped if t.path is not None])
        self.recovery.save_decisions(self.sampler, self.guard)
        return target.step

    def _restore(self, target: snap.Target) -> str | None:
        """Load ``target`` (memory if held, else disk after verifying); its source, or None
        when its disk copy is rejected."""
        if target.host is not None:
            snap.restore(target.host, self.module, self.optimizer, self.device)
            return "memory"
        if target.path is None:
            return None
        reason = self.recovery.verify(target.path)
        if reason is not None:
            self.recovery.reject(target.path, reason)
            self.guard.targets.drop(target)
            return None
        reader = CheckpointReader(target.path)
        load_into(
            reader, self.module, self.optimizer, self.state_layout, self.tp_layout,
            self.device, self.rank,
        )  # fmt: skip
        snap.after_load(self.module)
        target.consumed = int(reader.manifest["data"]["consumed"])
        return "disk"


def model_differences(folder: Path, model_cfg: ModelConfig) -> str:
    """``"; the checkpoint's model has n_layers=4 (this run: 2), ..."`` for the fields in
    which the model config recorded in ``folder``'s manifest differs, or ``""``."""
    try:
        saved = CheckpointReader(folder).manifest.get("model") or {}
    except (OSError, ValueError):
        return ""
    ours = dataclasses.asdict(model_cfg)
    differ = [
        f"{k}={saved[k]!r} (this run: {ours[k]!r})"
        for k in ours
        if k != "name" and k in saved and saved[k] != ours[k]
    ]
    return "; the checkpoint's model has " + ", ".join(differ) if differ else ""
