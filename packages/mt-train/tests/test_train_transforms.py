"""FP8 through the trainer on the CPU (mt_fp8's emulation path): the blocks' linears switch,
the output head stays high precision unless ``fp8.output_head``, training tracks the high-precision run, and delayed
scaling's state is checkpointed and restored. Also the other transforms: recompute, bf16
autocast and torch.compile."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from train_checks import tiny_overrides

from mt_train import Trainer, compose_config, to_train_config
from mt_train.checkpoint import CheckpointReader
from mt_train.models.build import fp8_emulation_warning


def _fit(data: Path, out: Path, **extra: object) -> tuple[Trainer, list[float]]:
    trainer = Trainer(
        to_train_config(compose_config(tiny_overrides(data, **extra))), output_dir=out
    )
    try:
        return trainer, trainer.fit().losses
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def fp32(kjv_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The tiny job's losses in fp32, the reference of every run below (trained once)."""
    return _fit(kjv_data, tmp_path_factory.mktemp("fp32"))[1]


@pytest.fixture(scope="module")
def tensorwise(
    kjv_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Trainer, list[float]]:
    """The tiny job with ``fp8=tensorwise`` (weight cache on): its closed trainer and losses."""
    return _fit(kjv_data, tmp_path_factory.mktemp("tensorwise"), fp8="tensorwise")


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_run_tracks_high_precision(
    recipe: str, kjv_data: Path, fp32: list[float], tensorwise: tuple, tmp_path: Path
) -> None:
    if recipe == "tensorwise":
        trainer, losses = tensorwise
    else:
        trainer, losses = _fit(kjv_data, tmp_path / recipe, fp8=recipe)
    assert trainer.fp8_layers == 2 * 7  # q, k, v, o, gate, up, down in each of 2 blocks
    assert not getattr(trainer.module.output, "fp8_enabled", False)
    # E4M3 keeps ~3 significant bits per element; after 8 steps of a 2-layer model the loss
    # differs from fp32 by well under 2%, while a broken scale or layout lands far off.
    assert losses == pytest.approx(fp32, rel=2e-2)


def test_fp8_output_head_is_opt_in(kjv_data: Path, fp32: list[float], tmp_path: Path) -> None:
    trainer, losses = _fit(
        kjv_data, tmp_path / "head", fp8="tensorwise", **{"fp8.output_head": True}
    )
    assert trainer.fp8_layers == 2 * 7 + 1  # the blocks' linears and the output head
    assert trainer.module.output.fp8_enabled
    # The logits and their gradient now carry E4M3/E5M2 rounding too; the same 2% bound as the
    # blocks-only run holds (a wrong head scale or layout would move the loss by far more).
    assert losses == pytest.approx(fp32, rel=2e-2)


def test_fp8_output_head_gemms_choose_the_head_gemms_in_fp8(
    kjv_data: Path, fp32: list[float], tmp_path: Path
) -> None:
    trainer, losses = _fit(
        kjv_data,
        tmp_path / "head",
        fp8="tensorwise",
        **{"fp8.output_head": True, "fp8.output_head_gemms": "[forward,dgrad]"},
    )
    head = trainer.module.output.fp8_linear
    assert head.fp8_gemms == {"forward", "dgrad"}
    assert all(
        m.fp8_linear.fp8_gemms == {"forward", "dgrad", "wgrad"}
        for m in trainer.module.layers[0].modules()
        if getattr(m, "fp8_enabled", False)
    )
    # Fewer FP8 GEMMs than the all-FP8 head: the same 2% bound holds.
    assert losses == pytest.approx(fp32, rel=2e-2)
    with pytest.raises(
        ValueError, match=r"fp8.output_head_gemms=\['forward'\] applies to an FP8 output head only"
    ):
        to_train_config(
            compose_config(tiny_overrides(kjv_data, **{"fp8.output_head_gemms": "[forward]"}))
        )
    with pytest.raises(ValueError, match=r"fp8.output_head_gemms: .*unknown GEMM names \['fwd'\]"):
        to_train_config(
            compose_config(
                tiny_overrides(
                    kjv_data, **{"fp8.output_head": True, "fp8.output_head_gemms": "[fwd]"}
                )
            )
        )


def test_fp8_gemms_choose_the_blocks_gemms_in_fp8(
    kjv_data: Path, fp32: list[float], tmp_path: Path
) -> None:
    trainer, losses = _fit(
        kjv_data, tmp_path / "no_wgrad", fp8="rowwise", **{"fp8.gemms": "[forward,dgrad]"}
    )
    fp8_layers = [m for m in trainer.module.modules() if getattr(m, "fp8_enabled", False)]
    assert len(fp8_layers) == 2 * 7  # the blocks' linears; the head stays bf16
    assert all(m.fp8_linear.fp8_gemms == {"forward", "dgrad"} for m in fp8_layers)
    # Fewer FP8 GEMMs than the all-FP8 blocks of test_fp8_run_tracks_high_precision: the same 2% bound.
    assert losses == pytest.approx(fp32, rel=2e-2)
    with pytest.raises(ValueError, match=r"fp8.gemms=\['wgrad'\] needs an FP8 recipe"):
        to_train_config(compose_config(tiny_overrides(kjv_data, **{"fp8.gemms": "[wgrad]"})))
    with pytest.raises(ValueError, match=r"fp8.gemms: .*unknown GEMM names \['bwd'\]"):
        to_train_config(
            compose_config(
                tiny_overrides(kjv_data, **{"fp8": "rowwise", "fp8.gemms": "[forward,bwd]"})
            )
        )


def test_fp8_weight_cache_off_trains_identically(
    kjv_data: Path, tensorwise: tuple, tmp_path: Path
) -> None:
    # The cache only saves re-quantizing the same weight: without it every forward quantizes
    # the weight again, to the same bytes, so the run is bitwise the same.
    cached_trainer, cached = tensorwise
    trainer, uncached = _fit(
        kjv_data, tmp_path / "uncached", fp8="tensorwise", **{"fp8.cache_weight": False}
    )
    layers = [m.fp8_linear for m in trainer.module.modules() if getattr(m, "fp8_enabled", False)]
    assert len(layers) == 2 * 7 and not any(layer.cache_weight for layer in layers)
    assert not any(layer.fp8_weight_cache for layer in layers)  # nothing kept between calls
    cached_layers = [
        m.fp8_linear for m in cached_trainer.module.modules() if getattr(m, "fp8_enabled", False)
    ]
    assert all(layer.cache_weight for layer in cached_layers)
    assert uncached == cached


def test_delayed_scaling_state_round_trips(kjv_data: Path, tmp_path: Path) -> None:
    trainer, _ = _fit(kjv_data, tmp_path, fp8="delayed")
    state = {k: v.clone() for k, v in trainer.module.state_dict().items() if "fp8" in k}
    assert state, "delayed scaling keeps amax history / scales in buffers"
    reader = CheckpointReader(tmp_path / "checkpoints" / "step-00000008")
    assert sorted(reader.manifest["fp8_state"]) == sorted(state)
    resumed = Trainer(
        to_train_config(
            compose_config(tiny_overrides(kjv_data, fp8="delayed", **{"checkpoint.resume": "auto"}))
        ),
        output_dir=tmp_path,
    )
    try:
        for key, value in resumed.module.state_dict().items():
            if key in state:
                assert torch.equal(value, state[key]), key
    finally:
        resumed.close()


def test_recompute_is_bitwise_neutral(kjv_data: Path, fp32: list[float], tmp_path: Path) -> None:
    _, recomputed = _fit(kjv_data, tmp_path / "recompute", parallel="recompute")
    trainer, kept = _fit(
        kjv_data,
        tmp_path / "keep",
        parallel="recompute",
        **{"parallel.recompute_keep": "[attention]"},
    )
    assert all(block.forward.args[1:] == (("attention",),) for block in trainer.module.layers)
    # Recompute replays the same ops (keeping the attention output reuses what the forward
    # computed), so the losses are identical.
    assert recomputed == fp32
    assert kept == fp32


def test_bf16_autocast_on_cpu_tracks_fp32(
    kjv_data: Path, fp32: list[float], tmp_path: Path
) -> None:
    _, bf16 = _fit(kjv_data, tmp_path / "bf16", **{"trainer.precision": "bf16"})
    # bf16 keeps 8 significant bits; the loss (computed in fp32 from bf16 logits) stays within 2%.
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != fp32


@pytest.mark.slow
def test_compiled_blocks_track_eager(kjv_data: Path, tmp_path: Path) -> None:
    # The smallest model (one block): compiling it forward and backward (and again for the
    # final evaluation in eval mode) takes ~35 s on two CPU cores with a cold inductor cache
    # (~6 s warm), the training itself <1 s.
    small = {
        "model.n_layers": 1, "model.dim": 32, "model.ffn_dim": 64, "trainer.max_steps": 6,
        "trainer.eval_interval": 6, "checkpoint.enabled": False,
    }  # fmt: skip
    _, eager = _fit(kjv_data, tmp_path / "eager", **small)
    trainer, compiled = _fit(kjv_data, tmp_path / "compiled", **small, **{"trainer.compile": True})
    assert trainer.module.layers[0]._compiled_call_impl is not None  # the block was compiled
    assert all(math.isfinite(x) for x in compiled) and compiled[-1] < 0.95 * compiled[0]
    # Inductor fuses the element-wise ops and may reorder reductions: measured 8.5e-8 relative
    # after 6 steps; 1e-5 still catches any real change (a lost op or mask moves it by >1e-3).
    assert compiled == pytest.approx(eager, rel=1e-5)


@pytest.mark.slow
def test_compiled_blocks_with_fp8_track_eager_fp8(kjv_data: Path, tmp_path: Path) -> None:
    # FP8 layers run eagerly between the compiled pieces of each block (mt_fp8.linear), so the
    # compiled FP8 trainer must train as the eager one does (on a GPU it once trained with
    # all-zero block gradients; docs/benchmarks-log.md).
    small = {
        "model.n_layers": 1, "model.dim": 32, "model.ffn_dim": 64, "trainer.max_steps": 6,
        "trainer.eval_interval": 6, "checkpoint.enabled": False, "fp8": "tensorwise",
        "fp8.min_features": 16,
    }  # fmt: skip
    eager_trainer, eager = _fit(kjv_data, tmp_path / "eager", **small)
    assert eager_trainer.fp8_layers == 7  # every block linear runs in FP8
    trainer, compiled = _fit(kjv_data, tmp_path / "compiled", **small, **{"trainer.compile": True})
    assert trainer.module.layers[0]._compiled_call_impl is not None
    assert all(math.isfinite(x) for x in compiled) and compiled[-1] < 0.95 * compiled[0]
    # Measured identical after 6 steps (the FP8 layers run the same eager code; the compiled
    # norms and RoPE matched in fp32 here). 1e-5 leaves room for a last-bit change in fused
    # kernels; zero block gradients would leave the blocks untrained and move it far more.
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_mxfp8_without_mx_tensor_cores_warns_naming_the_faster_recipes() -> None:
    # On Hopper (compute capability 9.0) MXFP8 runs mt_fp8's exact bf16 emulation, slower than
    # bf16 itself; the start-up line must say so and name the recipes with FP8 GEMMs there.
    line = fp8_emulation_warning("mxfp8", (9, 0), "NVIDIA H200")
    assert line is not None and "exact bf16 emulation, slower than bf16" in line
    assert "compute capability 9.0" in line and "NVIDIA H200" in line
    assert all(f"fp8={r}" in line for r in ("tensorwise", "rowwise", "delayed", "blockwise"))
    assert fp8_emulation_warning("mxfp8", (10, 0), "NVIDIA B200") is None
    assert fp8_emulation_warning("tensorwise", (9, 0), "NVIDIA H200") is None
