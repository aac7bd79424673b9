"""The vision-language model under pipeline parallelism on two gloo ranks (pp=2): the encoder,
projector and image placement run on the first stage, which receives each micro-batch's
images; later stages receive hidden states only. One step of ``vlm_tiny``'s shapes in float64
equals one process running the whole batch at once (the step's loss, the masked mean over the
whole batch; each micro-batch's loss; every gradient) under 1F1B and the split backward of
ZB-H1 and interleaved zero bubble, with image and trained-target counts that differ between
micro-batches (:mod:`vlm_checks`), and with tensorwise FP8 on both towers, whose first-stage
encoder linears defer their weight GEMMs to the split backward's sink. The digits captions
train as one process does (also with FP8 and full recompute under ZB-H1), and a pp=2 checkpoint resumes bit for bit at pp=2 and continues
one process's curve at pp=1. With captions of different lengths the step's loss is the masked
mean over the whole batch at every micro-batch size and pp (:mod:`mt_train.loss_weights`).
Packed rows (several samples per sequence) at pp=2 train as one process.
A pool shared across modules; references run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_checks
from test_train_vlm_parallel import vlm_overrides
from vlm_checks import FP64_BOUND, vlm_pipeline_step

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.hf_checkpoints import load_model

pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")

# fp32 on the CPU: a pipelined step runs each micro-batch's chunk forwards and backwards in
# the pp=1 accumulation loop's order, so the curves agree but for the gradient norm's sum of
# squares over two ranks (an ulp of the clip coefficient), as for Llama
# (test_train_pipeline.py); 8 AdamW steps stay below 1e-6.
RTOL = 1e-6
NO_DROPOUT = {"model.dropout": 0.0}
CONSTANT = {"scheduler": "constant"}


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.mark.parametrize(
    ("schedule", "chunks", "layers"),
    [("1f1b", 1, 2), ("zero_bubble", 1, 2), ("zero_bubble", 2, 4)],
    ids=["1f1b", "zero_bubble", "interleaved_zero_bubble"],
)
def test_pipelined_step_equals_one_process(
    pool: DistributedPool, schedule: str, chunks: int, layers: int
) -> None:
    per_rank = pool.run(vlm_pipeline_step, schedule, chunks, layers)
    graded = per_rank[0]["graded"]
    held = [set(r["grads"]) for r in per_rank]
    assert not held[0] & held[1] and held[0] | held[1] == set(graded)
    # The image tower is on the first stage (rank 0), the head on the last.
    assert any(n.startswith("vision.") for n in held[0]) and "projector.linear_1.weight" in held[0]
    assert "language.output.weight" in held[1]
    for result in per_rank:
        assert max(result["grads"].values()) < FP64_BOUND, result["grads"]
        if result["holds_last"]:
            assert len(result["losses"]) == 4 and max(result["losses"]) < FP64_BOUND
            assert result["total"][0] < FP64_BOUND
        else:
            assert result["losses"] == result["total"] == []
    # The micro-batches hold different numbers of trained targets: unequal weights.
    assert len(set(per_rank[0]["factors"])) == 4


@pytest.fixture(scope="module")
def reference(digits: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    overrides = vlm_overrides(digits, **NO_DROPOUT, **{"trainer.log_interval": 1})
    return train_checks.run_logged(overrides, tmp_path_factory.mktemp("single"))


def test_digits_at_pp2_match_one_process(
    pool: DistributedPool, digits: Path, reference: dict, tmp_path: Path
) -> None:
    """Losses of every step, and the token counts the model reports (logged by rank 0, which
    holds the first stage: they are summed over the pipeline)."""
    overrides = vlm_overrides(
        digits, **NO_DROPOUT, **{"trainer.log_interval": 1, "parallel": "pp2"}
    )
    per_rank = pool.run(train_checks.run_logged, overrides, tmp_path)
    assert per_rank[0]["losses"] == per_rank[1]["losses"]
    assert per_rank[0]["losses"] == pytest.approx(reference["losses"], rel=RTOL)
    assert reference["losses"][-1] < reference["losses"][0]
    rows, expected = (
        [r for r in run["rows"] if r["kind"] == "train"] for run in (per_rank[0], reference)
    )
    assert len(rows) == len(expected) == 8
    for row, ref in zip(rows, expected, strict=True):
        assert row["loss_tokens"] == ref["loss_tokens"] > 0
        assert row["masked_tokens"] == ref["masked_tokens"] > 0


def test_packed_digits_at_pp2_match_one_process(
    pool: DistributedPool, digits: Path, tmp_path: Path
) -> None:
    """Three samples per 64-token row: every stage's blocks take the per-sample RoPE
    positions (the layout's ``block_positions``), the first stage places each sample's image."""
    packed = {"data.pack_samples": True, "trainer.seq_len": 64, **NO_DROPOUT}
    single = train_checks.run_losses(vlm_overrides(digits, **packed), tmp_path / "single")
    overrides = vlm_overrides(digits, **packed, parallel="pp2")
    per_rank = pool.run(train_checks.run_losses, overrides, tmp_path / "pp2")
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(single, rel=RTOL)


def test_pp2_checkpoint_resumes_exactly_and_loads_at_pp1(
    pool: DistributedPool, digits: Path, tmp_path: Path
) -> None:
    """Dropout on for the resume (each stage's RNG state is in its checkpoint); off for the
    pp=2 to pp=1 load, which continues one process's curve."""
    # The 12-step run's own step-8 checkpoint is resumed: under the constant schedule a run
    # stopped at step 8 would have written the same one.
    pp2 = {"parallel": "pp2", **CONSTANT, "trainer.max_steps": 12}
    full = pool.run(train_checks.run_losses, vlm_overrides(digits, **pp2), tmp_path / "full")[0]
    step = tmp_path / "full" / "checkpoints" / "step-00000008"
    manifest = (step / "manifest.json").read_text()
    assert "model/vision.embeddings.patch" in manifest
    assert "model/language.layers.1.attention.q_proj.weight" in manifest
    resumed = pool.run(
        train_checks.run_losses,
        vlm_overrides(digits, **pp2, **{"checkpoint.resume": step}),
        tmp_path / "resumed",
    )
    assert resumed[0] == resumed[1] == full[8:]  # exact float equality, step by step

    plain = {**CONSTANT, **NO_DROPOUT}
    single = train_checks.run_losses(
        vlm_overrides(digits, **plain, **{"trainer.max_steps": 12}), tmp_path / "one"
    )
    pool.run(
        train_checks.run_losses,
        vlm_overrides(digits, **plain, **{"parallel": "pp2"}),
        tmp_path / "pp2",
    )
    # mt-convert's loader joins the stage files by name (a strict load of every tensor).
    exported = load_model(tmp_path / "pp2" / "checkpoints")
    tokens = torch.tensor([[1, 2, *[exported.cfg.image_token_id] * 4, 3]])
    assert torch.isfinite(exported(tokens, images=torch.zeros(1, 1, 8, 8))).all()
    resume = {"trainer.max_steps": 12, "checkpoint.resume": "auto"}
    at_pp1 = train_checks.run_losses(vlm_overrides(digits, **plain, **resume), tmp_path / "pp2")
    assert at_pp1 == pytest.approx(single[8:], rel=RTOL)


def test_fp8_encoder_weight_gradients_go_through_the_sink(pool: DistributedPool) -> None:
    """Tensorwise FP8 on both towers under ZB-H1: the encoder's and projector's FP8 linears
    on the first stage queue their weight-gradient GEMMs in the stage's sink (run as W)."""
    per_rank = pool.run(vlm_pipeline_step, "zero_bubble", fp8=True)
    first = per_rank[0]
    assert "vision.layers.0.mlp.fc1" in first["fp8_layers"] and first["sinks"] == 1
    assert "projector.linear_1" in first["fp8_layers"]
    for result in per_rank:
        # The same FP8 operands and GEMMs in the same order as one process (the sink's GEMM is
        # the fused backward's, mt_fp8.wgrad), gradients summed over micro-batches in order:
        # observed bit-equal; 1e-6 (a few fp32 ulps) is the bound.
        assert max(result["grads"].values()) < 1e-6, result["grads"]
        assert all(error < 1e-6 for error in result["losses"] + result["total"])


NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PREFIXES = ("", "a ", "a handwritten ")


@pytest.fixture(scope="module")
def varied_captions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 digits whose captions have 3 to 19 bytes (the bundled set's are all 15), so the
    micro-batches of a step hold different numbers of trained targets."""
    from mt_train.data.digits import load_digits_arrays
    from mt_train.data.image_text import IMAGE_PLACEHOLDER, write_image_text

    images, labels = load_digits_arrays()
    records = (
        (f"varied:{i}", Path("."), {"images": [images[i]], "prompt": IMAGE_PLACEHOLDER,
         "text": PREFIXES[i % 3] + NAMES[labels[i]]})
        for i in range(300)
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("varied")
    write_image_text(folder, records, (1, 8, 8), image_tokens=4, val_every=5)
    return folder


def test_masked_mean_over_the_whole_batch_at_any_micro_batch_and_pp(
    pool: DistributedPool, varied_captions: Path, tmp_path: Path
) -> None:
    """The step's loss is the masked mean over the whole global batch (mt_train.loss_weights):
    eight samples as one micro-batch, as four of two (pp=1) and as two of four through the
    pipeline (pp=2) train the same curve; the mean of the micro-batch means would not (a
    sample has 4 to 20 trained targets)."""
    plain = {**NO_DROPOUT, **CONSTANT, "data.path": str(varied_captions)}
    whole = train_checks.run_losses(
        vlm_overrides(varied_captions, **plain, **{"trainer.micro_batch_size": 8}),
        tmp_path / "whole",
    )
    accumulated = train_checks.run_losses(
        vlm_overrides(varied_captions, **plain, **{"trainer.micro_batch_size": 2}),
        tmp_path / "accumulated",
    )
    per_rank = pool.run(
        train_checks.run_losses,
        vlm_overrides(varied_captions, **plain, **{"parallel": "pp2"}),
        tmp_path / "pp2",
    )
    assert per_rank[0] == per_rank[1]
    # fp32: the layouts sum the same cross-entropies in other groupings (whole batch, or
    # micro-batch means weighted by n_m·M/N), a few ulps per step (observed 2e-7 after eight
    # AdamW steps); without the weights the curves differ from the first step on (1e-4).
    assert accumulated == pytest.approx(whole, rel=RTOL)
    assert per_rank[0] == pytest.approx(whole, rel=RTOL)


def test_fp8_and_full_recompute_under_zero_bubble_match_one_process(
    pool: DistributedPool, digits: Path, tmp_path: Path
) -> None:
    """The trainer's tensorwise FP8 on both towers, full recompute of the vision and decoder
    blocks, ZB-H1: the same three steps as one process with the same options."""
    extra = {**NO_DROPOUT, "fp8": "tensorwise", "model.fp8_vision": True,
             "parallel.recompute": "full", "trainer.max_steps": 3, "trainer.eval_interval": 3,
             "trainer.eval_batches": 1, "checkpoint.enabled": False}  # fmt: skip
    single = train_checks.run_losses(vlm_overrides(digits, **extra), tmp_path / "one")
    pp2 = {"parallel": "pp2", "parallel.pp_schedule": "zero_bubble"}
    per_rank = pool.run(
        train_checks.run_losses, vlm_overrides(digits, **extra, **pp2), tmp_path / "pp2"
    )
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(single, rel=RTOL)  # observed bit-equal
