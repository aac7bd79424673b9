"""Saving and restoring a run: model, optimizer, data position, RNG and FP8 state.

Tensor names in the shards (local names and pieces: :mod:`mt_train.checkpoint.state`):

* ``model/<key>`` — a replicated entry of the (tp=1-named) model state dict, including the
  FP8 scaling state that mt_fp8 keeps in buffers; written by the rank with dp×cp = tp = 0;
* ``model/<key>@tp<r>of<n>`` — TP rank ``r``'s slice of a tensor that ``mt_parallel``'s
  ``tp_shard_plan`` splits along one dimension over ``n`` ranks (written by its dp×cp-0 rank);
* ``optim/<param>/{step,exp_avg,exp_avg_sq}`` — AdamW state per named parameter, with the same
  ``@tp<r>of<n>`` suffix for the moments of TP-sharded parameters;
* ``<any of the above>@elems<a>-<b>of<n>`` — a piece: flattened elements ``[a, b)`` of that
  tensor (``n`` elements, its shape in the manifest's ``sharded_shapes``), written by the
  dp×cp rank that holds it (FSDP2 parameters and moments, ZeRO-1 moments); a rank holding
  several runs of a tensor (an FSDP2 shard along dim 1, :mod:`mt_train.checkpoint.state`)
  writes one piece per run, so pieces never depend on the dim a layout shards along;
* ``rng/rank<r>/<device>`` and ``rng/rank<r>/tracker/<stream>/<what>`` — every rank's torch
  generators and mt_parallel RNG-tracker states.

Reshard on load: a tensor is rebuilt whole (pieces concatenated in element order, TP slices
along their dimension; ``merge(shard(x)) == x`` exactly), then cut for the loading rank: its
TP slice, and under FSDP2 / ZeRO-1 its piece. Replicas over dp×cp are not stored twice and
the data position is global (samples consumed over all ranks), so a checkpoint loads at any
dp, cp, tp and data-parallel mode. RNG states are restored only into the layout that saved
them (same world size and tp, cp, dp); a run resumed at another layout re-seeds instead
(:meth:`mt_train.run_state.RunState.load`).

Async saving: :meth:`Checkpointer.save` first waits for the previous save, copies the state
to host memory (the snapshot: training may change the live tensors right after), and hands
the writing to a background thread; :meth:`wait` blocks until it is on disk. The bytes are
the same as a synchronous save because both write the same snapshot through the same code.

A write that fails (a full or read-only disk) raises :class:`mt_train.errors.DiskError`
naming the path and the errno, from :meth:`Checkpointer.save` or, for a background save, from
the first :meth:`Checkpointer.check` (the trainer calls it after every step) or
:meth:`Checkpointer.wait` after it failed; the half-written ``.tmp-step-*`` folder is removed
and the newest complete checkpoint is untouched.
"""

from __future__ import annotations

import concurrent.futures
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mt_train import fault_points
from mt_train.checkpoint.files import (
    CheckpointReader,
    latest_checkpoint,
    publish,
    remove_stale,
    restore_replaced,
    shard_name,
    tmp_dir,
    write_shard,
)
from mt_train.checkpoint.state import Run, StateLayout, load_state, restore_rng, take_runs
from mt_train.errors import DiskError

ELEMS = re.compile(r"@elems(\d+)-(\d+)of(\d+)$")
TP_SUFFIX = re.compile(r"@tp(\d+)of(\d+)")


@dataclass(frozen=True)
class TPLayout:
    """Which entries are TP-sharded (key → dim) and where this rank sits."""

    plan: dict[str, int]
    rank: int
    size: int

    def name(self, prefix: str, key: str, entry: str = "") -> str:
        suffix = f"@tp{self.rank}of{self.size}" if key in self.plan and self.size > 1 else ""
        return f"{prefix}{key}{entry}{suffix}"


def shard_tensors(
    local: dict[str, torch.Tensor],
    layout: StateLayout,
    tp: TPLayout,
    rank: int,
    dp_cp_rank: int,
) -> dict[str, torch.Tensor]:
    """This rank's shard from its local state (:func:`mt_train.checkpoint.state.live_state`
    names): whole model and optimizer entries only from dp×cp rank 0, pieces from the rank
    holding them (``@elems`` suffix, one per run of :attr:`StateLayout.runs`); entries
    replicated over TP only from TP rank 0, TP-sharded ones suffixed ``@tp<r>of<n>``; RNG
    states from every rank."""
    out = {}
    for name, value in local.items():
        kind, rest = name.split("/", 1)
        if kind == "rng":
            out[f"rng/rank{rank}/{rest}"] = value
            continue
        if kind == "model":
            key, stored = rest, tp.name("model/", rest)
        else:
            key, entry = rest.rsplit("/", 1)
            sharded = entry != "step" and key in tp.plan
            stored = tp.name("optim/", key, f"/{entry}") if sharded else name
        if (key not in tp.plan and tp.rank != 0) or name in layout.replicas:
            continue
        runs = layout.runs.get(name)
        if runs is None:
            if dp_cp_rank == 0:
                out[stored] = value
            continue
        total = math.prod(layout.shapes[name])
        if len(runs) == 1:  # the local tensor, in its own shape
            start, numel = runs[0]
            if numel > 0:
                out[f"{stored}@elems{start}-{start + numel}of{total}"] = value
            continue
        flat, offset = value.reshape(-1), 0
        for start, numel in runs:  # flat views of the local tensor, one per run
            out[f"{stored}@elems{start}-{start + numel}of{total}"] = flat[offset : offset + numel]
            offset += numel
    return out


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies (never views of live tensors), detached."""
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


class Checkpointer:
    """Writes checkpoints for one rank (rank 0 also publishes them); see the module docstring."""

    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        run_id: str,
        keep_last: int,
        async_save: bool,
    ) -> None:
        self.root, self.rank, self.world_size = root, rank, world_size
        self.run_id, self.keep_last, self.async_save = run_id, keep_last, async_save
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1) if async_save else None
        )
        self._pending: concurrent.futures.Future | None = None
        self.last_saved: Path | None = None

    def restore_replaced(self) -> None:
        """Rank 0, before any rank looks for a checkpoint to resume from (then a barrier):
        put back a checkpoint whose replacement was interrupted (:mod:`.files`)."""
        if self.rank == 0:
            restore_replaced(self.root)

    def prepare(self) -> None:
        """Rank 0, once before the first save (and after every rank stopped reading): drop
        folders of killed saves."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            remove_stale(self.root)

    def save(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        manifest: dict[str, Any],
        copy: bool = True,
        protect: frozenset[int] = frozenset(),
    ) -> None:
        """Save ``tensors`` (this rank's) and, on rank 0, ``manifest`` as checkpoint ``step``.

        ``copy=False``: ``tensors`` already are host copies nobody changes (a rewind
        snapshot). Pruning to ``keep_last`` spares the steps in ``protect``.
        """
        self.wait()
        host = snapshot(tensors) if copy else tensors
        if self._executor is None:
            self._write(step, host, manifest, protect)
        else:
            self._pending = self._executor.submit(self._write, step, host, manifest, protect)

    def _write(
        self,
        step: int,
        host: dict[str, torch.Tensor],
        manifest: dict[str, Any],
        protect: frozenset[int],
    ) -> None:
        folder = tmp_dir(self.root, step)
        try:
            write_shard(folder, self.rank, self.run_id, host, step)
            fault_points.save_phase("shard", step)
            if self.rank == 0:
                self.last_saved = publish(
                    self.root,
                    step,
                    self.world_size,
                    self.run_id,
                    manifest,
                    self.keep_last,
                    protect=protect,
                )
        except OSError as err:
            # Nothing of this save is published; rank 0 drops the folder, others their shard.
            if self.rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                (folder / shard_name(self.rank)).unlink(missing_ok=True)
            raise DiskError(f"checkpoint step {step}", err.filename or folder, err) from err

    def check(self) -> None:
        """Re-raise the error of a background save that has already failed (never waits)."""
        pending = self._pending
        if pending is not None and pending.done() and pending.exception() is not None:
            self.wait()

    def wait(self) -> None:
        """Block until the pending background save is on disk; re-raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()


def resolve_resume(mode: str, root: Path) -> Path | None:
    """The checkpoint to resume from: ``none`` → None, ``auto`` → newest in ``root``, or a path."""
    if mode == "none":
        return None
    if mode == "auto":
        return latest_checkpoint(root)
    return Path(mode)


def read_whole(reader: CheckpointReader, name: str) -> torch.Tensor:
    """Tensor ``name`` (a TP slice keeps its ``@tp`` suffix), joining its ``@elems`` pieces."""
    if reader.has(name):
        return reader.read([name])[name]
    pieces = reader.names(name + "@elems")
    if not pieces:
        raise KeyError(f"checkpoint {reader.folder} has no tensor {name!r}")
    ranges = sorted((*map(int, ELEMS.search(p).groups()), p) for p in pieces)  # type: ignore[union-attr]
    total, expected = ranges[0][2], 0
    for start, end, _, piece in ranges:
        if start != expected:
            raise ValueError(
                f"checkpoint {reader.folder}: {name} has no piece for elements "
                f"[{expected}, {start}) (next piece {piece})"
            )
        expected = end
    if expected != total:
        raise ValueError(f"checkpoint {reader.folder}: {name} pieces end at {expected} of {total}")
    loaded = reader.read([p for *_, p in ranges])
    # Flattened: a piece keeps its writer's local shape (an FSDP2 shard's rows) or is 1-D.
    flat = torch.cat([loaded[p].reshape(-1) for *_, p in ranges])
    return flat.view(reader.manifest["sharded_shapes"][TP_SUFFIX.sub("", name)])


def read_resharded(
    reader: CheckpointReader, name: str, dim: int | None, tp: TPLayout
) -> torch.Tensor:
    """``name`` for this rank: whole, or this rank's slice of its re-joined TP pieces."""
    if reader.has(name) or reader.names(name + "@elems"):
        full = read_whole(reader, name)
    else:
        pieces = reader.names(name + "@tp")
        if not pieces or dim is None:
            raise KeyError(f"checkpoint {reader.folder} has no tensor {name!r}")
        n = int(TP_SUFFIX.search(pieces[0]).group(2))  # type: ignore[union-attr]
        full = torch.cat([read_whole(reader, f"{name}@tp{r}of{n}") for r in range(n)], dim=dim)
    if dim is None or tp.size == 1:
        return full
    return full.chunk(tp.size, dim=dim)[tp.rank]


def load_into(
    reader: CheckpointReader,
    model: nn.Module,
    optimizer: Any,
    layout: StateLayout,
    tp: TPLayout,
    device: Any,
    rng_rank: int | None = None,
) -> None:
    """Restore model and optimizer state (any tp/cp/dp layout and data-parallel mode) from
    ``reader``, and with ``rng_rank`` that rank's RNG states (when the checkpoint has them)."""

    def source(name: str, live: torch.Tensor, runs: list[Run] | None) -> torch.Tensor | None:
        key = name.split("/", 1)[1]
        if name.startswith("optim/"):
            key, entry = key.rsplit("/", 1)
            if entry == "step":
                return reader.read([name])[name] if reader.has(name) else None
        if not (reader.has(name) or reader.names(name + "@")):
            return None
        full = read_resharded(reader, name, tp.plan.get(key), tp)
        expected = layout.shapes.get(name, list(live.shape))
        if list(full.shape) != expected:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(full.shape)} here, the model "
                f"{tuple(expected)}: is the model config the same?"
            )
        if runs is None:
            return full
        return take_runs(full.reshape(-1), runs).view_as(live)

    load_state(model, optimizer, layout, source)
    prefix = f"rng/rank{rng_rank}/"
    if rng_rank is None or not reader.has(prefix + "cpu"):
        return
    names = reader.names(prefix)
    rng = reader.read(names)
    restore_rng({"rng/" + n[len(prefix) :]: rng[n] for n in names}, device)
