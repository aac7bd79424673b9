"""Helpers shared by the mt-train tests, importable by spawned DistributedPool workers.

``tiny_overrides`` shrinks the default job to a 2-layer, width-64 Llama on 64-token
sequences so that a step takes milliseconds on a CPU; ``run_losses`` trains it and returns
the per-step losses (module level so spawned ranks can run it by name), ``run_summary`` the
losses and the greedy sample, ``run_weights`` the losses and the final weights a rank holds.
``rewind_overrides`` adds rewind with windows sized for a 60-step run; ``run_rewind`` trains
and returns what a rank saw (losses, its in-memory events) as plain data; ``run_collated``
also returns the training rows this rank collated, step by step. ``blend_sources`` writes the
two-source byte-token blend the ``data.blend`` tests train on.
``snapshot_round_trip`` checks that an in-memory snapshot restores this rank's state
(whatever the data-parallel mode shards).

In a gloo pool's ranks every function here builds its trainer from one composed config: rank 0
composes the overrides and sends the :class:`~mt_train.config.schema.TrainConfig` to the other
ranks (``train_config``). Composing (Hydra's defaults tree and merges) costs a rank a large
part of the CPU a tiny run takes, and the config does not depend on the rank or the world
size (the layout is checked against the world when the trainer starts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mt_train import Trainer, compose_config, to_train_config
from mt_train.checkpoint.state import live_state
from mt_train.config.schema import TrainConfig
from mt_train.rewind import capture, restore


def tiny_overrides(data: str | Path, **extra: object) -> list[str]:
    base = {
        "data.path": str(data),
        "model.dim": 64,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "model.ffn_dim": 128,
        "trainer.seq_len": 64,
        "trainer.global_batch_size": 8,
        "trainer.micro_batch_size": 4,
        "trainer.max_steps": 8,
        "trainer.log_interval": 4,
        "trainer.eval_interval": 8,
        "trainer.eval_batches": 2,
        "trainer.checkpoint_interval": 4,
        "trainer.sample_tokens": 0,
        "logging.progress_bar": False,
        "scheduler.warmup_steps": 2,
        "checkpoint.async_save": False,
    }
    base.update(extra)
    return [f"{k}={'null' if v is None else v}" for k, v in base.items()]


def rewind_overrides(data: str | Path, **extra: object) -> list[str]:
    """The tiny job with rewind on, 60 steps, checkpoints every 4 steps, stable after 4."""
    base: dict[str, object] = {
        "rewind": "default",
        "trainer.max_steps": 60,
        "trainer.eval_interval": 60,
        "trainer.eval_batches": 8,
        "trainer.checkpoint_interval": 4,
        "rewind.warmup_steps": 10,
        "rewind.window": 20,
        "rewind.min_samples": 5,
        "rewind.stable_after": 4,
        "rewind.lr_cooldown_steps": 8,
    }
    base.update(extra)
    return tiny_overrides(data, **base)


def train_config(overrides: list[str]) -> TrainConfig:
    """The validated config of ``overrides``; in a process group of several ranks composed by
    rank 0 and sent to the others (module docstring), a composing error raised on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return to_train_config(compose_config(overrides))
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = to_train_config(compose_config(overrides))
        except Exception as err:  # the other ranks wait for the config: send them the error
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def fit(overrides: list[str], output_dir: str | Path) -> tuple[Trainer, Any]:
    """Train with ``overrides`` to the end; the (closed) trainer and its summary."""
    trainer = Trainer(train_config(overrides), output_dir=output_dir)
    try:
        return trainer, trainer.fit()
    finally:
        trainer.close()


def run_rewind(overrides: list[str], output_dir: str | Path) -> dict:
    """Train; this rank's losses, step, validation loss and event records."""
    trainer, summary = fit(overrides, output_dir)
    return {
        "steps": summary.steps,
        "losses": summary.losses,
        "val_loss": summary.val_loss,
        "rewinds": summary.rewinds,
        "events": trainer.events.records,
    }


def run_collated(overrides: list[str], output_dir: str | Path) -> dict:
    """``run_rewind``'s record plus ``collated``: for every training step this rank ran
    (undone ones included), the training-set rows it collated, in order."""
    trainer = Trainer(train_config(overrides), output_dir=output_dir)
    collated: list[list[int]] = []
    next_step, collate = trainer.sampler.next_step, trainer.collate

    def drawing() -> Any:
        collated.append([])
        return next_step()

    def recording(dataset: Any, indices: Any) -> Any:
        if dataset is trainer.data.train:
            collated[-1].extend(int(i) for i in indices)
        return collate(dataset, indices)

    trainer.sampler.next_step = drawing  # type: ignore[method-assign]
    trainer.collate = recording  # type: ignore[method-assign]
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return {
        "steps": summary.steps,
        "losses": summary.losses,
        "events": trainer.events.records,
        "collated": collated,
    }


def blend_sources(folder: Path) -> str:
    """Two byte-token sources under ``folder`` (``bible``, ``verse``; 20 documents each); the
    ``data.blend`` override weighting them 3:1."""
    from mt_train.data import ByteTokenizer, write_prepared

    docs = {"bible": "In the beginning God created", "verse": "And the earth was without form"}
    for name, text in docs.items():
        write_prepared(folder / name, [f"{text} {i}. " * 9 for i in range(20)], ByteTokenizer(), 4)
    return f"'3 {folder / 'bible'} 1 {folder / 'verse'}'"


def run_losses(overrides: list[str], output_dir: str | Path) -> list[float]:
    """Train with ``overrides`` and return the loss of every step."""
    return fit(overrides, output_dir)[1].losses


def run_weights(overrides: list[str], output_dir: str | Path) -> dict:
    """Train; the per-step losses and the final weights this rank holds, by parameter name."""
    trainer, summary = fit(overrides, output_dir)
    weights = {name: p.detach().clone() for name, p in trainer.module.named_parameters()}
    return {"losses": summary.losses, "weights": weights}


def run_logged(overrides: list[str], output_dir: str | Path) -> dict:
    """Train; the per-step losses and (on rank 0, which logs) the metric rows written."""
    summary = fit(overrides, output_dir)[1]
    path = Path(output_dir) / "metrics.jsonl"
    rows = []
    if os.environ.get("RANK", "0") == "0" and path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {"losses": summary.losses, "rows": rows}


MODEL_METRIC_PREFIXES = ("ce_loss", "moe_", "mtp_loss")


def model_metrics(rows: list[dict]) -> dict[tuple[int, str], float]:
    """The model's logged extras (CE, MoE losses and load statistics, MTP losses) of every
    train row, by ``(step, name)``."""
    return {
        (row["step"], key): value
        for row in rows
        if row["kind"] == "train"
        for key, value in row.items()
        if key.startswith(MODEL_METRIC_PREFIXES)
    }


def first_step_gradients(
    overrides: list[str], output_dir: str | Path, loss_factors: list[float] | None = None
) -> dict:
    """One step's forward and backward (no update): the reported loss and extras, and this
    rank's gradients by parameter name."""
    trainer = Trainer(train_config(overrides), output_dir=output_dir)
    try:
        micro = trainer.sampler.next_step()
        batches = [trainer.collate(trainer.data.train, indices) for indices in micro]
        result = trainer.step_runner.run(batches, loss_factors, None, eager=True)
        grads = {
            name: p.grad.detach().clone()
            for name, p in trainer.module.named_parameters()
            if p.grad is not None
        }
        extras = {name: float(value) for name, value in result.extras.items()}
        return {"loss": float(result.total), "extras": extras, "grads": grads}
    finally:
        trainer.close()


def run_summary(overrides: list[str], output_dir: str | Path) -> dict:
    """Train; the per-step losses and the greedy sample."""
    summary = fit(overrides, output_dir)[1]
    return {"losses": summary.losses, "sample": summary.sample}


def gradient_average_timeline(overrides: list[str], output_dir: str | Path) -> list[tuple]:
    """One pipelined step under ``data_parallel=ddp``: this rank's backward actions and the
    starts of its chunks' dp×cp gradient averages, in the order they ran (``("backward",
    stage)`` per ``B``/``I``/``W``, ``("average", stage)`` per start)."""
    trainer = Trainer(train_config(overrides), output_dir=output_dir)
    try:
        schedule = trainer.step_runner.schedule
        events: list[tuple] = []
        for stage in schedule.runtime._stages:
            for name in ("backward_one_chunk", "backward_weight_one_chunk"):
                run = getattr(stage, name)

                def logged(*args, _run=run, _stage=stage.stage_index, **kwargs):
                    events.append(("backward", _stage))
                    return _run(*args, **kwargs)

                setattr(stage, name, logged)
        start = schedule.on_chunk_gradients
        stage_of = {id(s.submod): s.stage_index for s in schedule.runtime._stages}

        def started(chunk):
            events.append(("average", stage_of[id(chunk)]))
            start(chunk)

        schedule.on_chunk_gradients = started
        trainer.train_step()
    finally:
        trainer.close()
    return events


def bucketed_average_timeline(
    overrides: list[str], output_dir: str | Path, bucket_bytes: int, in_backward: bool = True
) -> dict[str, Any]:
    """One pipelined step under ``data_parallel=ddp`` with ``ddp`` buckets of ``bucket_bytes``:
    this rank's last backward of each chunk (``("last", stage)`` when it starts, ``("end",
    stage)`` when it returns) and each bucket average's start (``("bucket", n)``, n
    parameters), in order, and the parameters after the step. Without ``in_backward`` no
    stage says it is in its last backward, so every bucket starts at ``REDUCE_GRAD``."""
    from unittest import mock

    import mt_parallel
    from mt_train import pipeline_step

    events: list[tuple] = []
    start = mt_parallel.start_gradient_average

    def logged(params, group):
        params = list(params)
        events.append(("bucket", len(params)))
        return start(params, group)

    with (
        mock.patch.object(pipeline_step, "BUCKET_BYTES", bucket_bytes),
        mock.patch.object(mt_parallel, "start_gradient_average", logged),
    ):
        trainer = Trainer(train_config(overrides), output_dir=output_dir)
        try:
            schedule = trainer.step_runner.schedule
            if not in_backward:
                schedule.in_last_backward = lambda chunk: False
            for stage in schedule.runtime._stages:
                for name in ("backward_one_chunk", "backward_weight_one_chunk"):
                    run = getattr(stage, name)

                    def marked(*args, _run=run, _stage=stage.stage_index, **kwargs):
                        last = kwargs.get("last_backward", False)
                        if last:
                            events.append(("last", _stage))
                        try:
                            return _run(*args, **kwargs)
                        finally:
                            if last:
                                events.append(("end", _stage))

                    setattr(stage, name, marked)
            trainer.train_step()
            params = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
        finally:
            trainer.close()
    return {"events": events, "params": params}


def snapshot_round_trip(overrides: list[str], output_dir: str | Path) -> dict:
    """Two steps, capture, two more steps, restore: which local entries differ from the
    capture (none should), how many there were, and whether training goes on."""
    trainer = Trainer(train_config(overrides), output_dir=output_dir)
    try:
        for _ in range(2):
            trainer.train_step()
        host = capture(trainer.module, trainer.optimizer, trainer.ctx.device)
        for _ in range(2):
            trainer.train_step()
        moved = [
            k
            for k, v in live_state(trainer.module, trainer.optimizer, trainer.ctx.device).items()
            if not torch.equal(v.cpu(), host[k])
        ]
        restore(host, trainer.module, trainer.optimizer, trainer.ctx.device)
        live = live_state(trainer.module, trainer.optimizer, trainer.ctx.device)
        differ = sorted(k for k in host if k not in live or not torch.equal(live[k].cpu(), host[k]))
        loss = trainer.train_step()["loss"]
    finally:
        trainer.close()
    return {"entries": sorted(host), "moved": len(moved), "differ": differ, "loss": loss}


def export_round_trip(hf_folder: Path, work: Path) -> Path:
    """``mt-convert import`` a transformers folder, ``export`` it back, and assert every tensor
    of the exported safetensors equals the original bit for bit; the exported folder."""
    from safetensors.torch import load_file

    from mt_train.hf_checkpoints import main

    assert main(["import", str(hf_folder), str(work / "mt")]) == 0
    assert main(["export", str(work / "mt"), str(work / "back")]) == 0
    original = load_file(str(next(hf_folder.glob("*.safetensors"))))
    back = load_file(str(work / "back" / "model.safetensors"))
    assert original.keys() == back.keys()
    for key, tensor in original.items():
        assert torch.equal(tensor, back[key]), key
    return work / "back"
