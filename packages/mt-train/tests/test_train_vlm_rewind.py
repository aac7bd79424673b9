"""Rewind with the vision-language model, in one process (dropout on): a NaN loss (the target
restored from memory) or a loss spike (from disk, ``rewind.memory_snapshots=false``) at step
10 rewinds the digits run to the newest stable checkpoint, step 4, and it finishes its 12
steps. Right after the rewind every model entry, AdamW moment and random generator equals that
checkpoint's, and the run never trains on the skipped draws: it ran the fault-free order's
steps 1-10, then the steps after 10 (the Llama scenarios: test_train_rewind.py).

Checkpoints every 4 steps, stable after 4: at the anomaly 9 steps are done, so step-8 is one
healthy step old (not stable) and step-4 is the newest stable checkpoint. The spike detector
waits for 5 steps in its baseline; the digits loss falls from the first step on, and the
median of a falling curve lags above it, so only the injected 10x spike exceeds 1.5x median.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_vlm_parallel import vlm_overrides

from mt_train import Trainer, compose_config, to_train_config
from mt_train.checkpoint.files import CheckpointReader
from mt_train.checkpoint.state import live_state
from mt_train.rewind import read_events

pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")

STEPS, FAULT, STABLE = 12, 10, 4
G = 8  # global batch
COOLDOWN = 4
FAULTS = {
    "nan": ({"fault.nan_at_step": FAULT}, "non_finite", "memory"),
    "spike": (
        {"fault.spike_at_step": FAULT, "rewind.memory_snapshots": False},
        "loss_spike",
        "disk",
    ),
}


def rewind_overrides(data: Path, **extra: object) -> list[str]:
    base: dict[str, object] = {
        "rewind": "default",
        "trainer.max_steps": STEPS,
        "trainer.eval_interval": STEPS,
        "rewind.warmup_steps": 5,
        "rewind.window": 10,
        "rewind.min_samples": 5,
        "rewind.stable_after": 4,
        "rewind.lr_cooldown_steps": COOLDOWN,
    }
    return vlm_overrides(data, **base, **extra)


def fit_recording(overrides: list[str], output_dir: Path) -> dict[str, Any]:
    """Train; the summary's steps, rewinds and losses, the global draws ``[a, b)`` of every
    step run (undone ones included), and for each rewind the entries of the live state that
    differ from the restored checkpoint's (read from disk right after the rewind)."""
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=output_dir)
    draws: list[tuple[int, int]] = []
    restored: list[dict[str, Any]] = []
    next_step, rewind = trainer.sampler.next_step, trainer.state.rewind

    def drawing() -> Any:
        micro = next_step()
        draws.append(trainer.sampler.last_draws)
        return micro

    def rewinding(*args: Any) -> int:
        step = rewind(*args)
        folder = output_dir / "checkpoints" / f"step-{step:08d}"
        reader = CheckpointReader(folder)
        live = live_state(trainer.module, trainer.optimizer, trainer.ctx.device)
        # The checkpoint names this process's generators rng/rank0/...
        saved = {n.replace("rng/rank0/", "rng/"): n for n in reader.names()}
        assert saved.keys() == live.keys()
        tensors = reader.read(list(saved.values()))
        differ = [n for n, v in live.items() if not torch.equal(v, tensors[saved[n]])]
        restored.append({"step": step, "entries": sorted(live), "differ": differ})
        return step

    trainer.sampler.next_step = drawing  # type: ignore[method-assign]
    trainer.state.rewind = rewinding  # type: ignore[method-assign]
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return {
        "steps": summary.steps,
        "rewinds": summary.rewinds,
        "losses": summary.losses,
        "draws": draws,
        "restored": restored,
    }


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_rewinds_to_the_stable_checkpoint(name: str, digits: Path, tmp_path: Path) -> None:
    extra, detector, source = FAULTS[name]
    result = fit_recording(rewind_overrides(digits, **extra), tmp_path)
    assert result["steps"] == STEPS and result["rewinds"] == 1
    (rewind,) = [e for e in read_events(tmp_path) if e["event"] == "rewind"]
    assert rewind["step"] == FAULT - 1 and rewind["detector"] == detector
    assert rewind["restored"] == {
        "step": STABLE,
        "path": str(tmp_path / "checkpoints" / f"step-{STABLE:08d}"),
        "in_memory": source == "memory",
        "stable": True,
        "source": source,
    }
    assert rewind["skipped"] == {
        "policy": "window",
        "draws": [[STABLE * G, FAULT * G]],
        "steps": FAULT - STABLE,
    }
    assert rewind["lr_cooldown"] == {"factor": 0.5, "steps": COOLDOWN}
    assert rewind["discarded"] == [8]

    (restored,) = result["restored"]
    assert restored["step"] == STABLE and restored["differ"] == []
    for prefix in ("model/vision.", "model/projector.", "optim/vision.", "rng/cpu"):
        assert any(e.startswith(prefix) for e in restored["entries"]), prefix

    # Draw for draw: steps 1-10 as drawn uninterrupted, then steps 5-12 on the draws of
    # uninterrupted steps 11-18; the skipped draws of steps 5-10 come back at no step.
    ran = [(s * G, (s + 1) * G) for s in range(FAULT)]
    ran += [(s * G, (s + 1) * G) for s in range(FAULT, FAULT + STEPS - STABLE)]
    assert result["draws"] == ran
    losses = result["losses"]  # the healthy steps: 1-9, then 5-12
    assert len(losses) == FAULT - 1 + STEPS - STABLE
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
