"""``benchmarks/plain_llama.py``, the plain PyTorch reference of the quality runs, trains exactly as
mt-train does when both start from the same weights on the same windows.

Both run the debug-sized model in fp32 on the CPU for a few steps, the plain loop from mt's
initial weights (``fp8_quality.write_initial_weights``, what ``--plain-init mt`` does), and
log every step's loss. They differ only by summation order (about 1e-7 relative per op), which
a few steps keep far below the 1e-5 bound; a different schedule, decay group, clipping,
sampler order or model function moves a loss by 1e-3 or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import fp8_quality
import numpy as np
import plain_llama

from mt_train import Trainer, compose_config, to_train_config
from mt_train.data.prepare import prepare_bundled

STEPS = 6


def _losses(folder: Path) -> list[float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row.get("kind") == "train"]


def test_the_plain_loop_trains_as_mt_train_from_the_same_weights(tmp_path: Path) -> None:
    data = tmp_path / "data"
    prepare_bundled(data)
    shape = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}
    overrides = [
        f"data.path={data}", "trainer.precision=fp32", "trainer.seq_len=64",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=8",
        f"trainer.max_steps={STEPS}", "trainer.log_interval=1", f"trainer.eval_interval={STEPS}",
        "trainer.eval_batches=1", "trainer.sample_tokens=0", "checkpoint.enabled=false",
        "logging.progress_bar=false", "optimizer.lr=3e-3", "scheduler.warmup_steps=2",
        *(f"model.{k}={v}" for k, v in shape.items()),
    ]  # fmt: skip
    trainer = Trainer(to_train_config(compose_config(overrides)), tmp_path / "mt")
    init = tmp_path / "init.safetensors"
    fp8_quality.write_initial_weights(init, trainer.model_cfg, trainer.cfg.trainer.seed)
    mt = trainer.fit().losses
    cfg = trainer.model_cfg
    plain_llama.main(
        [
            "--data", str(data), "--out", str(tmp_path / "plain"), "--steps", str(STEPS),
            "--seq-len", "64", "--batch", "8", "--lr", "3e-3", "--warmup", "2",
            "--eval-interval", str(STEPS), "--eval-batches", "1", "--log-interval", "1",
            "--seed", str(trainer.cfg.trainer.seed), "--vocab-size", str(cfg.vocab_size),
            "--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "128",
            "--rope-theta", str(cfg.rope_theta), "--rope-factor", str(cfg.rope_scaling.factor),
            "--init-from", str(init),
        ]
    )  # fmt: skip
    plain = _losses(tmp_path / "plain")
    assert len(plain) == len(mt) == STEPS
    assert plain[0] - plain[-1] > 0.5  # it trains, so a wrong step would show
    np.testing.assert_allclose(plain, mt, rtol=0, atol=1e-5)
