"""Saving and restoring a run: model, optimizer, data position, RNG and FP8 state.

Tensor names in the shards:

* ``model/<key>`` — a replicated entry of the (tp=1-named) model state dict, including the
  FP8 scaling state that mt_fp8 keeps in buffers; written by the rank with dp = tp = 0;
* ``model/<key>@tp<r>of<n>`` — TP rank ``r``'s slice of a tensor that ``mt_parallel``'s
  ``tp_shard_plan`` splits along one dimension over ``n`` ranks (written by its dp-0 rank);
* ``optim/<param>/{step,exp_avg,exp_avg_sq}`` — AdamW state per named parameter, with the same
  ``@tp<r>of<n>`` suffix for the moments of TP-sharded parameters;
* ``rng/rank<r>/<device>`` — every rank's torch RNG states (CPU and its accelerator).

Reshard on load: a TP-sharded tensor is rebuilt by concatenating its ``n`` slices along its
dimension and cut again for the loading run's tp degree (``merge(shard(x)) == x`` exactly).
Replicas over dp are not stored twice, and the data position is global (samples consumed over
all ranks), so a checkpoint also loads at another dp degree; a rank without its own RNG entry
takes rank 0's.

Async saving: :meth:`Checkpointer.save` first waits for the previous save, copies the state
to host memory (the snapshot: training may change the live tensors right after), and hands
the writing to a background thread; :meth:`wait` blocks until it is on disk. The bytes are
the same as a synchronous save because both write the same snapshot through the same code.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mt_train.checkpoint.files import (
    CheckpointReader,
    latest_checkpoint,
    publish,
    remove_stale,
    tmp_dir,
    write_shard,
)
from mt_train.models.build import canonical_key

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {canonical_key(k): p for k, p in model.named_parameters()}


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
    local: dict[str, torch.Tensor], tp: TPLayout, rank: int, dp_rank: int
) -> dict[str, torch.Tensor]:
    """This rank's shard from its local state (:func:`mt_train.rewind.snapshot.live_state`
    names): model and optimizer entries only from dp rank 0 (replicated ones only from TP rank
    0, TP-sharded ones suffixed ``@tp<r>of<n>``), RNG states from every rank."""
    out = {}
    for name, value in local.items():
        kind, rest = name.split("/", 1)
        if kind == "rng":
            out[f"rng/rank{rank}/{rest}"] = value
            continue
        if dp_rank != 0:
            continue
        if kind == "model":
            if rest in tp.plan or tp.rank == 0:
                out[tp.name("model/", rest)] = value
            continue
        param, key = rest.rsplit("/", 1)
        if param not in tp.plan and tp.rank != 0:
            continue
        sharded = key != "step" and param in tp.plan
        out[tp.name("optim/", param, f"/{key}") if sharded else name] = value
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
        write_shard(tmp_dir(self.root, step), self.rank, self.run_id, host)
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


def read_resharded(
    reader: CheckpointReader, name: str, dim: int | None, tp: TPLayout
) -> torch.Tensor:
    """``name`` for this rank: whole, or this rank's slice of its re-joined TP pieces."""
    if reader.has(name):
        full = reader.read([name])[name]
    else:
        pieces = reader.names(name + "@tp")
        if not pieces or dim is None:
            raise KeyError(f"checkpoint {reader.folder} has no tensor {name!r}")
        n = int(pieces[0].rsplit("of", 1)[1])
        ordered = [f"{name}@tp{r}of{n}" for r in range(n)]
        loaded = reader.read(ordered)
        full = torch.cat([loaded[k] for k in ordered], dim=dim)
    if dim is None or tp.size == 1:
        return full
    return full.chunk(tp.size, dim=dim)[tp.rank]


def load_into(
    reader: CheckpointReader,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    device: Any,
    tp: TPLayout,
) -> None:
    """Restore model, optimizer and RNG state of ``rank`` from ``reader`` (any tp/dp layout)."""
    with torch.no_grad():
        for key, live in model.state_dict().items():
            short = canonical_key(key)
            src = read_resharded(reader, f"model/{short}", tp.plan.get(short), tp)
            if src.shape != live.shape:
                raise ValueError(
                    f"checkpoint tensor {short} has shape {tuple(src.shape)} here, the model "
                    f"{tuple(live.shape)}: is the model config the same?"
                )
            live.copy_(src)
    if optimizer is not None:
        fused = any(g.get("fused") for g in optimizer.param_groups)
        for name, param in named_parameters(model).items():
            if not reader.has(f"optim/{name}/step"):
                continue
            dim = tp.plan.get(name)
            optimizer.state[param] = {
                "step": reader.read([f"optim/{name}/step"])[f"optim/{name}/step"].to(
                    param.device if fused else "cpu"
                ),
                "exp_avg": read_resharded(reader, f"optim/{name}/exp_avg", dim, tp).to(
                    param.device
                ),
                "exp_avg_sq": read_resharded(reader, f"optim/{name}/exp_avg_sq", dim, tp).to(
                    param.device
                ),
            }
    own = f"rng/rank{rank}/"
    prefix = own if reader.has(own + "cpu") else "rng/rank0/"
    if not reader.has(prefix + "cpu"):
        return  # weights only (an mt-convert import)
    rng = reader.read(reader.names(prefix))
    torch.set_rng_state(rng[prefix + "cpu"])
    if device.type != "cpu" and prefix + device.type in rng:
        device.set_rng_state(rng[prefix + device.type])
