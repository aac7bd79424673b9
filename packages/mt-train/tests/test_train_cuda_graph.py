"""``trainer.cuda_graph``: what it refuses (CPU); on the CPU, the step graph's inputs (the loss
factors a replay reads from a device buffer, as the eager step multiplies by them) with a
stand-in for the CUDA graph that reruns the recorded step on the same buffers; and on a GPU
that replayed steps train exactly as eager ones, through gradient accumulation, evaluation,
FP8 recipes, masked targets and a rewind."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from train_checks import fit, rewind_overrides, tiny_overrides

from mt_train import Trainer, compose_config, to_train_config
from mt_train.cuda_graph import GraphedStep, StepGraph, cuda_graph_blockers
from mt_train.data.dataset import Batch
from mt_train.loss_weights import token_weights
from mt_train.step import BatchRunner, GradNorm, StepResult


def test_cuda_graph_refuses_a_cpu_run(kjv_data: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(kjv_data, **{"trainer.device": "cpu", "trainer.cuda_graph": True})
    with pytest.raises(ValueError, match=r"trainer\.cuda_graph=true .*device 'cpu' is not cuda"):
        Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)


def test_cuda_graph_blockers_name_each_reason() -> None:
    assert cuda_graph_blockers("cuda", 1, 1, 1, 0.0, "ddp", 1) == []
    assert cuda_graph_blockers("cuda", 1, 1, 1, 0.0, "none", 4) == []
    assert cuda_graph_blockers("cuda", 1, 1, 1, 0.0, "zero1", 4) == []
    reasons = cuda_graph_blockers("cuda", 2, 2, 1, 0.1, "fsdp", 4)
    assert len(reasons) == 4
    assert "parallel.tp=2" in reasons[0] and "parallel.cp=2" in reasons[1]
    assert "parallel.data_parallel=fsdp over 4 ranks" in reasons[2]
    assert "model.dropout=0.1" in reasons[3]


class ToyLM(nn.Module):
    """Embedding, tanh, output head: the model interface ``BatchRunner`` calls."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8, dtype=dtype)
        self.head = nn.Linear(8, 11, dtype=dtype)

    def forward(self, tokens: torch.Tensor, *_: Any) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def toy_runner(dtype: torch.dtype) -> tuple[ToyLM, BatchRunner, list[Batch]]:
    torch.manual_seed(0)
    model = ToyLM(dtype)
    runner = BatchRunner(model, model, torch.device("cpu"), None, 1, 0, None)
    batches = [Batch(torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))) for _ in range(3)]
    return model, runner, batches


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_backward_reads_loss_factors_from_a_tensor_as_from_floats(
    dtype: torch.dtype,
) -> None:
    model, runner, batches = toy_runner(dtype)
    factors = [0.7, 1.0, 1.9]  # unequal masked-target weights; the float path skips the 1.0
    results = {}
    for kind, given in (("floats", factors), ("tensor", torch.tensor(factors, dtype=dtype))):
        model.zero_grad(set_to_none=True)
        results[kind] = runner.forward_backward(batches, given).total, grads_of(model)
    # Exactly: both multiply each loss by its factor rounded to the loss's dtype (x·1 is x).
    assert torch.equal(results["tensor"][0], results["floats"][0])
    for name, grad in results["floats"][1].items():
        assert torch.equal(results["tensor"][1][name], grad), name
    if dtype == torch.float64:
        # Reference: Σ_m f_m·∇loss_m / M, each micro-batch's gradient on its own; float64
        # rounding of a few sums is ~1e-16 relative, far inside 1e-12.
        params = list(model.parameters())
        want = [torch.zeros_like(p) for p in params]
        for f, b in zip(factors, batches, strict=True):
            loss = model.loss(model(b.inputs), b.targets)
            for w, g in zip(want, torch.autograd.grad(loss, params), strict=True):
                w += f * g / len(batches)
        for (name, grad), w in zip(results["tensor"][1].items(), want, strict=True):
            torch.testing.assert_close(grad, w, rtol=1e-12, atol=1e-15, msg=name)


class CpuReplay:
    """Stands in for a CUDA graph on the CPU: a replay runs the recorded step again on the same
    input buffers and writes its results into the captured tensors, which is what a graph
    replay leaves behind. A step that handed a replay stale or rebound buffers computes stale
    numbers here as on the device."""

    def __init__(
        self,
        step: Callable[[], StepResult],
        result: StepResult,
        grads: list[tuple[nn.Parameter, torch.Tensor]],
    ) -> None:
        self.step, self.result, self.grads = step, result, grads

    def replay(self) -> None:
        for p, _ in self.grads:
            p.grad = None
        new = self.step()
        self.result.total.copy_(new.total)
        for name, value in new.extras.items():
            self.result.extras[name].copy_(value)
        if new.norm is not None:
            self.result.norm.copy_(new.norm)
        for p, grad in self.grads:
            grad.copy_(p.grad)


def cpu_capture(
    micro_batches: Callable[[list[Batch], torch.Tensor], StepResult],
    batches: list[Batch],
    params: list[nn.Parameter],
    grad_norm: GradNorm | None = None,
) -> StepGraph:
    """``StepGraph.capture`` with :class:`CpuReplay` for the graph (the same input buffers)."""
    inputs, factors = StepGraph.input_buffers(batches)

    def step() -> StepResult:
        result = micro_batches(inputs, factors)
        if grad_norm is not None:
            result.norm = grad_norm([p for p in params if p.grad is not None])
        return result

    for p in params:
        p.grad = None
    result = step()
    grads = [(p, p.grad) for p in params if p.grad is not None]
    return StepGraph(CpuReplay(step, result, grads), inputs, factors, result, grads)


def test_the_step_graph_copies_each_steps_loss_factors_into_its_buffer() -> None:
    model, runner, batches = toy_runner(torch.float32)
    graph = cpu_capture(runner.forward_backward, batches, list(model.parameters()))
    buffer = graph.factors.data_ptr()
    for factors in ([0.5, 2.0, 1.25], [float("nan"), 1.0, 1.0], None):
        result = graph.run(batches, factors)
        got = result.total.clone(), grads_of(model)
        assert graph.factors.data_ptr() == buffer  # in place: the graph reads this memory
        assert graph.factors.tolist() == pytest.approx(factors or [1.0] * 3, nan_ok=True)
        model.zero_grad(set_to_none=True)
        want = runner.forward_backward(batches, factors)
        # Exactly the eager step's numbers (NaN where a NaN fault factor puts it).
        torch.testing.assert_close(got[0], want.total, rtol=0, atol=0, equal_nan=True)
        for name, grad in grads_of(model).items():
            torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="got 2 loss factors for 3 micro-batches"):
        graph.run(batches, [1.0, 1.0])


class RecordingRunner:
    """A ``BatchRunner`` stand-in that records the factors each eager step was given."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.given: list[Any] = []

    def forward_backward(self, batches: list[Batch], factors: Any = None) -> StepResult:
        self.given.append(factors)
        return StepResult(torch.zeros(()))


def test_eager_graphed_steps_keep_their_factors_and_a_run_of_them_is_reported() -> None:
    runner = RecordingRunner()
    step = GraphedStep(runner)  # type: ignore[arg-type]
    two = toy_runner(torch.float32)[2][:2]
    step.run(two, [0.5, 2.0])  # the warm-up: the capture's multiply by a factor tensor
    assert runner.given[0].dtype == torch.float32 and runner.given[0].tolist() == [0.5, 2.0]
    assert step.never_replayed() is None
    step.run(two, [3.0, 1.0], eager=True)  # e.g. the FP8 input fault's step
    assert runner.given[-1] == [3.0, 1.0]
    assert (step.eager_steps, step.replays) == (2, 0)
    warning = step.never_replayed()
    assert warning is not None and "all 2 steps of this run ran eagerly" in warning


def packed_vlm_overrides(data: Path, device: str, max_steps: int) -> list[str]:
    """Packed rows of samples with zero, one or two images (``prepare_varied``): one row per
    micro-batch, two per step, so the rows' trained targets and the loss weights differ."""
    from test_train_vlm_packing import SEQ_LEN

    return [
        "model=vlm_tiny", f"data.path={data}", f"trainer.device={device}",
        "data.pack_samples=true", f"trainer.seq_len={SEQ_LEN}", f"trainer.max_steps={max_steps}",
        "trainer.global_batch_size=2", "trainer.micro_batch_size=1", "trainer.eval_interval=5",
        "trainer.eval_batches=1", "scheduler.warmup_steps=1", "checkpoint.enabled=false",
        "logging.progress_bar=false", "model.dropout=0.0",
    ]  # fmt: skip


def test_masked_target_steps_replay_the_graph_with_their_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trainer with trainer.cuda_graph's step object and the CPU stand-in for the graph:
    # every step replays but the warm-up and the FP8 input fault's (step 4), whatever the
    # masked-target weights, and the replays train as the eager run does.
    from test_train_vlm_packing import prepare_varied

    (tmp_path / "data").mkdir()
    prepare_varied(tmp_path / "data", val_every=2)
    overrides = [
        *packed_vlm_overrides(tmp_path / "data" / "out", "cpu", 6),
        "fault.fp8_overflow_at_step=4",
    ]
    monkeypatch.setattr(StepGraph, "capture", staticmethod(cpu_capture))
    losses: dict[bool, list[float]] = {}
    for graphed in (False, True):
        trainer = Trainer(to_train_config(compose_config(overrides)), tmp_path / str(graphed))
        try:
            if graphed:
                trainer.step_runner = GraphedStep(trainer.runner)
            losses[graphed], weights, buffers = [], [], []
            for _ in range(6):
                losses[graphed].append(trainer.train_step()["loss"])
                weights.append(token_weights(trainer.data.train, trainer.sampler))
                if trainer.step_graph is not None:
                    buffers.append(trainer.step_graph.factors)
        finally:
            trainer.close()
    assert any(w != [1.0, 1.0] for w in weights), weights  # the weights matter here
    step = trainer.step_runner
    assert (step.eager_steps, step.replays) == (2, 4) and step.never_replayed() is None
    assert len({b.data_ptr() for b in buffers}) == 1
    assert buffers[-1].tolist() == pytest.approx(weights[-1], rel=1e-7)  # float32 of f_m
    # Exactly: the same float32 operations, each loss times its weight rounded to float32.
    assert losses[True] == losses[False]


def _losses(overrides: list[str], out: Path, graphed: bool) -> tuple[list[float], Any]:
    """Per-step losses of a fit, and its step object (with the graph's replay counts)."""
    cfg = to_train_config(compose_config([*overrides, f"trainer.cuda_graph={graphed}"]))
    trainer = Trainer(cfg, output_dir=out)
    try:
        summary = trainer.fit()
        assert not graphed or trainer.step_graph is not None
        return summary.losses, trainer.step_runner
    finally:
        trainer.close()


def _graphed_equals_eager(overrides: list[str], tmp_path: Path) -> list[float]:
    """Fit eagerly and with the step graph; the graphed run replayed every step after the
    warm-up and its per-step losses are the eager run's to 1e-4 (the bound of
    test_graphed_steps_train_as_eager_steps). Returns the eager losses."""
    eager, _ = _losses(overrides, tmp_path / "eager", graphed=False)
    graphed, step = _losses(overrides, tmp_path / "graphed", graphed=True)
    assert (step.eager_steps, step.replays) == (1, len(graphed) - 1)
    assert graphed == pytest.approx(eager, rel=1e-4), (graphed, eager)
    return eager


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", ["none", "tensorwise", "delayed", "blockwise"])
def test_graphed_steps_train_as_eager_steps(kjv_data: Path, tmp_path: Path, fp8: str) -> None:
    # Two micro-batches per step (accumulation inside the graph), an evaluation at step 6 (eager
    # forwards between replays), FP8 scales and histories updated in place between replays.
    # The replay runs the eager step's kernels on the same data; the bound allows for cuBLAS
    # choosing another algorithm under capture (bf16 rounding of one GEMM, ~1e-3 relative,
    # would show as ~1e-4 in the mean loss); a replay on stale inputs, weights or gradients
    # moves the loss by percents after a few steps. Width 128: the block recipe needs features
    # divisible by 128 (the 64-wide k/v projections stay high precision by min_features).
    overrides = tiny_overrides(
        kjv_data,
        **{
            "trainer.device": "cuda",
            "fp8": fp8,
            "fp8.min_features": 128,
            "model.dim": 128,
            "model.ffn_dim": 256,
            "trainer.max_steps": 12,
            "trainer.eval_interval": 6,
            "optimizer.lr": 3e-3,
        },
    )
    eager = _graphed_equals_eager(overrides, tmp_path)
    assert eager[-1] < 0.9 * eager[0], eager  # it trains


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flex", "explicit"])
def test_graphed_document_masked_steps_train_as_eager_steps(
    kjv_data: Path, tmp_path: Path, kernel: str
) -> None:
    # Document masks rebuilt from each micro-batch's document ids inside the captured step
    # (FlexAttention's block mask, or SDPA's boolean mask): a replay that kept the captured
    # step's masks would attend across other documents and leave the eager losses. Bound as
    # above.
    overrides = tiny_overrides(
        kjv_data,
        **{
            "trainer.device": "cuda",
            "data.document_masking": True,
            "data.document_masking_kernel": kernel,
            "trainer.max_steps": 10,
            "trainer.eval_interval": 5,
            "optimizer.lr": 3e-3,
        },
    )
    _graphed_equals_eager(overrides, tmp_path)


@pytest.mark.gpu
def test_a_graphed_run_rewinds_as_an_eager_run(kjv_data: Path, tmp_path: Path) -> None:
    # The NaN step replays the graph (its loss factor is a captured input), and so does the
    # bad batch's spiked step; the rewind restores the parameters in place and drops the
    # graph, which the next step captures again. Bound as above, over a longer run.
    overrides = rewind_overrides(
        kjv_data,
        **{
            "trainer.device": "cuda", "fault.nan_at_step": 30, "fault.bad_batch_at_step": 45,
            "fp8": "tensorwise",
        },
    )  # fmt: skip
    eager = fit(overrides, tmp_path / "eager")[1]
    trainer, graphed = fit([*overrides, "trainer.cuda_graph=true"], tmp_path / "graphed")
    assert graphed.rewinds == eager.rewinds == 2
    assert graphed.steps == eager.steps
    assert graphed.losses == pytest.approx(eager.losses, rel=1e-3, nan_ok=True)
    assert torch.isfinite(torch.tensor(graphed.val_loss))
    assert trainer.step_runner.eager_steps == 1  # the warm-up only


@pytest.mark.gpu
def test_the_graph_computes_the_gradient_norm_the_eager_step_computes(
    kjv_data: Path, tmp_path: Path
) -> None:
    # One data-parallel rank: the norm is captured with the backward (mt_train.cuda_graph).
    # The per-step norms are the clipping's input, so a stale or wrong captured norm (e.g. of
    # the capture's gradients) would differ by far more than the bound above allows.
    overrides = tiny_overrides(
        kjv_data, **{"trainer.device": "cuda", "fp8": "tensorwise", "optimizer.lr": 3e-3}
    )
    norms = {}
    for graphed in (False, True):
        cfg = to_train_config(compose_config([*overrides, f"trainer.cuda_graph={graphed}"]))
        trainer = Trainer(cfg, output_dir=tmp_path / str(graphed))
        try:
            norms[graphed] = [trainer.train_step()["grad_norm"] for _ in range(5)]
            if graphed:
                assert trainer.step_graph is not None and trainer.step_graph.norm is not None
        finally:
            trainer.close()
    assert len(set(norms[True])) == 5  # a new norm every step
    assert norms[True] == pytest.approx(norms[False], rel=1e-4), norms


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True])
def test_a_delayed_fp8_step_synchronises_with_the_host_once(
    kjv_data: Path, tmp_path: Path, graphed: bool
) -> None:
    # The one intended sync is the transfer of the numbers the detectors judge (loss, norm, FP8
    # saturation). Any other (a blocking host-to-device copy, an .item()) holds the host until
    # the queued kernels finish, and the device then idles while the host launches what follows;
    # the delayed-scaling update once made one per step. PyTorch's sync debug mode warns once
    # per synchronising call.
    overrides = tiny_overrides(
        kjv_data,
        **{
            "trainer.device": "cuda",
            "trainer.cuda_graph": graphed,
            "fp8": "delayed",
            "fp8.min_features": 128,
            "model.dim": 128,
            "model.ffn_dim": 256,
            "rewind": "default",
        },
    )
    trainer = Trainer(to_train_config(compose_config(overrides)), output_dir=tmp_path)
    try:
        assert trainer.watch_fp8
        for _ in range(3):  # graphed: eager warm-up, capture, first replay
            trainer.train_step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [
            f"{w.filename}:{w.lineno}: {w.message}"
            for w in caught
            if "called a synchronizing CUDA operation" in str(w.message)
        ]
        assert graphed == (trainer.step_graph is not None)
        assert len(syncs) == 1, syncs
    finally:
        trainer.close()


@pytest.mark.gpu
def test_graphed_vlm_steps_carry_each_steps_images(digits: Path, tmp_path: Path) -> None:
    # The step graph copies each micro-batch's images into its own buffer: a replay that kept
    # the captured step's images (or none) would train on the wrong pictures and its losses
    # would leave the eager run's after the first replays. Bound as above.
    pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")
    overrides = [
        "model=vlm_tiny", "data=digits", f"data.path={digits}", "trainer.device=cuda",
        "trainer.seq_len=32", "trainer.max_steps=10", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4", "trainer.eval_interval=5", "trainer.eval_batches=1",
        "scheduler.warmup_steps=1", "checkpoint.enabled=false", "logging.progress_bar=false",
        "model.dropout=0.0",  # a graph would replay the captured step's dropout masks
    ]  # fmt: skip
    _graphed_equals_eager(overrides, tmp_path)


@pytest.mark.gpu
def test_graphed_packed_vlm_steps_train_as_eager_steps(tmp_path: Path) -> None:
    # Packed rows of samples with zero, one or two images: the batches' image counts differ,
    # so the captured step takes each batch padded to a fixed count (zero images no
    # placeholder takes) while the eager step takes the batch's own; their trained targets
    # differ too, so every step replays with its own masked-target weights (on the CPU:
    # test_masked_target_steps_replay_the_graph_with_their_weights). Bound as above.
    from test_train_vlm_packing import prepare_varied

    (tmp_path / "data").mkdir()
    prepare_varied(tmp_path / "data", val_every=2)  # five held-out samples: one sequence
    overrides = packed_vlm_overrides(tmp_path / "data" / "out", "cuda", 10)
    _graphed_equals_eager(overrides, tmp_path)
