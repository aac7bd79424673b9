"""Saving and restoring a run: model, optimizer, data position, RNG and FP8 state.

Tensor names in the shards:

* ``model/<param or buffer>`` — the model state dict with wrapper prefixes removed (this
  includes FP8 scaling state, which mt_fp8 keeps in module buffers); written by the ranks
  whose data-parallel coordinate is 0, since the other dp ranks hold identical replicas;
* ``optim/<param>/{step,exp_avg,exp_avg_sq}`` — AdamW state per named parameter (same ranks);
* ``rng/rank<r>/<device>`` — every rank's torch RNG states (CPU and its accelerator).

Because the model state sits in whole tensors and the data position is global (samples
consumed over all ranks), a checkpoint loads at another dp degree: every rank reads the
dp-rank-0 tensors, and a rank without its own RNG entry takes rank 0's.

Async saving: :meth:`Checkpointer.save` first waits for the previous save, copies the state
to host memory (the snapshot: training may change the live tensors right after), and hands
the writing to a background thread; :meth:`wait` blocks until it is on disk. The bytes are
the same as a synchronous save because both write the same snapshot through the same code.
"""

from __future__ import annotations

import concurrent.futures
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
from mt_train.models.build import unwrap_state_dict_key

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {unwrap_state_dict_key(k): p for k, p in model.named_parameters()}


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {unwrap_state_dict_key(k): v for k, v in model.state_dict().items()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in named_parameters(model).items():
        state = optimizer.state.get(param, {})
        for key in ADAM_KEYS:
            if key in state:
                out[f"optim/{name}/{key}"] = state[key]
    return out


def rng_state(rank: int, device: Any) -> dict[str, torch.Tensor]:
    out = {f"rng/rank{rank}/cpu": torch.get_rng_state()}
    if device.type != "cpu":
        out[f"rng/rank{rank}/{device.type}"] = device.get_rng_state()
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

    def save(self, step: int, tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> None:
        """Save ``tensors`` (this rank's) and, on rank 0, ``manifest`` as checkpoint ``step``."""
        self.wait()
        host = snapshot(tensors)
        if self._executor is None:
            self._write(step, host, manifest)
        else:
            self._pending = self._executor.submit(self._write, step, host, manifest)

    def _write(self, step: int, host: dict[str, torch.Tensor], manifest: dict[str, Any]) -> None:
        write_shard(tmp_dir(self.root, step), self.rank, self.run_id, host)
        if self.rank == 0:
            self.last_saved = publish(
                self.root, step, self.world_size, self.run_id, manifest, self.keep_last
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


def load_into(
    reader: CheckpointReader,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    device: Any,
) -> None:
    """Restore model, optimizer and RNG state of ``rank`` from ``reader``."""
    live = model.state_dict()
    wanted = {unwrap_state_dict_key(k): k for k in live}
    names = [f"model/{k}" for k in wanted]
    missing = [n for n in names if not reader.has(n)]
    if missing:
        raise ValueError(
            f"checkpoint {reader.folder} lacks {len(missing)} model tensors, e.g. {missing[:3]}"
        )
    loaded = reader.read(names)
    with torch.no_grad():
        for short, key in wanted.items():
            src = loaded[f"model/{short}"]
            if src.shape != live[key].shape:
                raise ValueError(
                    f"checkpoint tensor {short} has shape {tuple(src.shape)}, the model "
                    f"{tuple(live[key].shape)}: is the model config the same?"
                )
            live[key].copy_(src)
    if optimizer is not None:
        params = named_parameters(model)
        state = reader.read([n for n in reader.names("optim/")])
        for name, param in params.items():
            entry = {
                key: state[f"optim/{name}/{key}"]
                for key in ADAM_KEYS
                if f"optim/{name}/{key}" in state
            }
            if not entry:
                continue
            fused = any(g.get("fused") for g in optimizer.param_groups)
            entry["step"] = entry["step"].to(param.device if fused else "cpu")
            entry["exp_avg"] = entry["exp_avg"].to(param.device)
            entry["exp_avg_sq"] = entry["exp_avg_sq"].to(param.device)
            optimizer.state[param] = entry
    own = f"rng/rank{rank}/"
    prefix = own if reader.has(own + "cpu") else "rng/rank0/"
    rng = reader.read(reader.names(prefix))
    torch.set_rng_state(rng[prefix + "cpu"])
    if device.type != "cpu" and prefix + device.type in rng:
        device.set_rng_state(rng[prefix + device.type])
