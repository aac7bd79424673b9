"""The turn-taking under DualPipeV's overlap function (:mod:`mt_parallel.pipeline.overlap`), in
one process: the halves alternate at each switch, a half that ends lets the other run alone,
a forward's error reaches the caller after the backward has ended, and the forward draws the
random numbers it draws alone while the backward's generator state is its own; the forward's
thread saves under the caller's saved-tensor hooks (an activation meter counts it)."""

from __future__ import annotations

import torch

from mt_parallel.pipeline import ActivationMeter
from mt_parallel.pipeline.overlap import _callers_context, _Turns

CPU = torch.device("cpu")


def _forward(turns_of: list[_Turns], log: list[str], steps: int, fail_at: int = -1):
    def run() -> str:
        for step in range(steps):
            if step == fail_at:
                raise ValueError("forward failed")
            log.append(f"F{step}")
            turns_of[0].switch()
        return "output"

    return run


def test_halves_alternate_and_the_longer_one_ends_alone() -> None:
    log: list[str] = []
    holder: list[_Turns] = []
    turns = _Turns(_forward(holder, log, steps=2), CPU)
    holder.append(turns)
    turns.start()
    for step in range(4):
        log.append(f"B{step}")
        turns.switch()
    turns.finish()
    assert log == ["F0", "B0", "F1", "B1", "B2", "B3"]
    assert turns.result == "output" and turns.error is None


def test_forward_runs_to_its_end_after_the_backward() -> None:
    log: list[str] = []
    holder: list[_Turns] = []
    turns = _Turns(_forward(holder, log, steps=3), CPU)
    holder.append(turns)
    turns.start()
    log.append("B0")
    turns.switch()
    turns.finish()
    assert log == ["F0", "B0", "F1", "F2"] and turns.result == "output"


def test_forward_error_is_kept_for_the_caller() -> None:
    log: list[str] = []
    holder: list[_Turns] = []
    turns = _Turns(_forward(holder, log, steps=3, fail_at=1), CPU)
    holder.append(turns)
    turns.start()
    for step in range(2):
        log.append(f"B{step}")
        turns.switch()
    turns.finish()
    assert log == ["F0", "B0", "B1"]
    assert isinstance(turns.error, ValueError)


def test_each_half_keeps_its_generator_state() -> None:
    torch.manual_seed(0)
    alone = torch.rand(3)
    after_alone = torch.get_rng_state()
    torch.manual_seed(0)
    drawn: list[torch.Tensor] = []
    holder: list[_Turns] = []

    def forward() -> None:
        for _ in range(3):
            drawn.append(torch.rand(1))
            holder[0].switch()

    turns = _Turns(forward, CPU)
    holder.append(turns)
    turns.start()
    for _ in range(3):
        torch.manual_seed(123)  # what a recomputation replaying a saved state does
        torch.rand(5)
        turns.switch()
    turns.finish()
    assert torch.equal(torch.cat(drawn), alone)
    assert torch.equal(torch.get_rng_state(), after_alone)


def test_the_forward_thread_saves_under_the_callers_hooks() -> None:
    """A forward on the overlap thread under an :class:`ActivationMeter` the caller entered:
    the meter counts the bytes it saves (the matmul's input, for the weight's gradient, and the
    tanh's output: two 8×8 float64 tensors) and their release once the graph is freed, as for
    a forward on the caller's thread; without the caller's hooks it would count nothing."""
    weight = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    outputs: list[torch.Tensor] = []

    def forward() -> None:
        with enter():
            outputs.append(torch.tanh(torch.ones(8, 8, dtype=torch.float64) @ weight))

    with ActivationMeter([weight]) as meter:
        enter = _callers_context(CPU)
        turns = _Turns(forward, CPU)
        turns.start()
        turns.finish()
        assert meter.bytes == 2 * 8 * 8 * 8
        outputs.clear()
    assert meter.bytes == 0 and meter.peak == 2 * 8 * 8 * 8
