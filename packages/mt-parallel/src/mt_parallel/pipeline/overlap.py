"""DualPipeV's ``OVERLAP_F_B``: one chunk's forward interleaved with another chunk's backward at
the MoE all-to-alls, so each half's expert-parallel exchanges travel while the other computes.

An ``OVERLAP_F_B`` action pairs ``F(a, m)`` (the forward of micro-batch ``m`` through chunk
``a``) with ``B(b, n)`` (the full backward of micro-batch ``n`` through chunk ``b ≠ a``) on
one rank; torch's runtime runs them one after the other unless a function is registered for
the action (:func:`overlap_forward_backward`, registered by
:class:`~mt_parallel.pipeline.PipelineSchedule`). This one runs the two halves as two
sequential programs that take turns (DeepSeek's DualPipe interleaving):

* the forward runs on a thread of its own, the backward on the caller's thread (torch's
  autograd engine runs it there on the CPU, on its device thread on an accelerator), and
  exactly one of the two runs at any moment: no tensor, module or autograd state is touched
  by both at once, and each keeps its own thread-local state (grad mode, autocast, saved-tensor
  hooks, the graph task a recomputation checks); the forward's starts as the caller's was
  when the pair began (:func:`_callers_context`), the saved-tensor hooks included, so a hook
  the caller entered (an activation meter, offloading) sees the forward's saved tensors as
  it would in torch's back-to-back ``F``;
* a half gives the turn away only right after it starts one of its MoE row all-to-alls
  (:func:`mt_parallel.moe.dispatch.all_to_all_in_flight`: dispatch and combine in the forward,
  their transposes in the backward) and takes it back to wait for it. The forward starts
  first; the sequence on each rank is then ::

      F: layer 1 to its dispatch ─┐ B: head ... last MoE layer's combine-grad ─┐ F: wait,
      experts, start combine ─┐ B: wait, experts' backward, start dispatch-grad ─┐ F: wait, ...

  so every row all-to-all one half starts is in flight while the other half computes up to
  its next one, until one half ends (the other then runs alone to its end, its exchanges
  blocking). The ``P×L`` count exchange before each dispatch stays blocking (it sizes the
  rows), as do all other collectives (TP, sequence parallel, the all-gather dispatcher).

Correctness. Each half computes exactly what it computes alone (no value depends on when the
other half ran), so losses and gradients equal torch's back-to-back run bit for bit. The
points where the turn changes depend only on the model's structure, so every rank of an ep
(or tp) group, which holds the same chunks and runs the same action list, issues its
collectives in the same order. Random numbers: the process has one generator per device, so
each half keeps its own generator state across turns (saved when it gives the turn away,
restored when it takes it back); the forward draws the numbers it draws in torch's order, and
afterwards the generators hold the forward's final state, as after torch's ``F`` then ``B``
(whose backward draws none of its own: a recomputed forward replays its saved state).

What torch gives the function, and what we repeat. The runtime hands a registered function
the action and a context (the runtime, the micro-batches' arguments, keyword arguments and
targets), not its own executor of ``F`` and ``B`` (a closure inside its step), so
:func:`overlap_forward_backward` repeats that bookkeeping for the two halves: wait for the
received activations and gradients, ``forward_one_chunk`` then the loss on the last chunk,
the backward counter and ``backward_one_chunk``, and the hand-over to a neighbouring chunk
on the same rank (the V's middle). The tests hold it to torch's own back-to-back run.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining.schedules import _PipelineContext, _wait_batch_p2p

import mt_fp8
from mt_parallel.mappings import group_size
from mt_parallel.moe.dispatch import all_to_all_in_flight
from mt_parallel.moe.layer import moe_layers
from mt_parallel.pipeline.schedules import Action, B, F


def overlaps_all_to_all(chunks: Sequence[nn.Module]) -> bool:
    """Whether :func:`overlap_forward_backward` has an exchange to overlap in ``chunks``: an MoE
    layer whose experts are split over ep > 1 ranks with the all-to-all dispatcher. Every rank
    of an ep (or tp) group holds the same chunks, so all of them decide alike."""
    return any(
        group_size(layer.ep_group) > 1 and layer.cfg.dispatcher == "all_to_all"
        for chunk in chunks
        for layer in moe_layers(chunk)
    )


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and ``device``'s (None on the CPU)."""
    on_device = None
    if device.type != "cpu":
        on_device = torch.get_device_module(device).get_rng_state(device)
    return torch.get_rng_state(), on_device


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device).set_rng_state(state[1], device)


def _callers_context(device: torch.device) -> Callable[[], contextlib.ExitStack]:
    """A context that gives another thread the caller's thread-local settings a forward reads:
    grad mode, ``device``'s autocast, the current accelerator stream, ``mt_fp8.fp8_autocast``,
    the innermost saved-tensor hooks (the pair autograd applies)."""
    grad = torch.is_grad_enabled()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    autocast = torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
    stream = torch.accelerator.current_stream(device) if device.type != "cpu" else None
    fp8 = mt_fp8.current_fp8_state()

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        stack.enter_context(torch.autocast(device.type, autocast[1], enabled=autocast[0]))
        if stream is not None:
            torch.accelerator.set_stream(stream)  # this thread's own; it ends with the forward
        if fp8 is not None:
            stack.enter_context(mt_fp8.fp8_autocast(fp8.enabled, fp8.recipe, fp8.amax_group))
        if hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
        return stack

    return enter


class _Turns:
    """A forward on its own thread and the caller's backward taking turns (module docstring).

    :meth:`switch` is the all-to-alls' ``while_in_flight``: called on the forward's thread it
    hands the turn to the backward, anywhere else to the forward, and returns when the turn
    comes back (at once when the other half has ended).
    """

    def __init__(self, forward: Callable[[], Any], device: torch.device) -> None:
        self._device = device
        self._lock = threading.Condition()
        self._forward_turn = False
        self._forward_done = self._backward_done = False
        start = _rng_state(device)
        self._rng = {True: start, False: start}
        """Each half's generator state while the other runs (keyed by "is the forward")."""
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run_forward, args=(forward,), name="mt-pipeline-overlap", daemon=True
        )

    def _run_forward(self, forward: Callable[[], Any]) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._forward_turn)
        _set_rng_state(self._device, self._rng[True])
        try:
            self.result = forward()
        except BaseException as error:  # re-raised on the caller's thread after finish()
            self.error = error
        self._rng[True] = _rng_state(self._device)
        with self._lock:
            self._forward_done, self._forward_turn = True, False
            self._lock.notify_all()

    def _hand_to_forward(self) -> None:
        """Run the forward until it gives the turn back or ends (backward side)."""
        with self._lock:
            if self._forward_done:
                return
            self._rng[False] = _rng_state(self._device)
            self._forward_turn = True
            self._lock.notify_all()
            self._lock.wait_for(lambda: not self._forward_turn)
        _set_rng_state(self._device, self._rng[False])

    def switch(self) -> None:
        if threading.current_thread() is not self._thread:
            self._hand_to_forward()
            return
        with self._lock:
            if self._backward_done:
                return
            self._rng[True] = _rng_state(self._device)
            self._forward_turn = False
            self._lock.notify_all()
            self._lock.wait_for(lambda: self._forward_turn)
        _set_rng_state(self._device, self._rng[True])

    def start(self) -> None:
        """Start the forward and run it to its first all-to-all."""
        self._thread.start()
        self._hand_to_forward()

    def finish(self) -> None:
        """The backward has ended: run the forward to its end and leave the generators in its
        final state."""
        with self._lock:
            self._backward_done = True
        self._hand_to_forward()
        self._thread.join()
        _set_rng_state(self._device, self._rng[True])


def _halves(action: Action) -> tuple[Action, Action]:
    subs = action.sub_actions or ()
    kinds = [a.computation_type for a in subs]
    if kinds != [F, B]:
        raise ValueError(
            f"{action}: an overlapped pair is a forward then a full backward (F, B), got "
            f"{[k.value for k in kinds]}"
        )
    return subs[0], subs[1]


def _wait_received(received: dict, action: Action, stage: int, mb: int) -> None:
    if (stage, mb) not in received:
        raise RuntimeError(f"{action}: chunk {stage} runs micro-batch {mb} before receiving it")
    _wait_batch_p2p(received.pop((stage, mb)))


def overlap_forward_backward(action: Action, ctx: _PipelineContext) -> None:
    """Run an ``OVERLAP_F_B`` action's two halves taking turns at the MoE all-to-alls
    (module docstring); torch's ``register_custom_function`` signature."""
    runtime = ctx.schedule_ref
    forward, backward = _halves(action)
    stages = {stage.stage_index: stage for stage in runtime._stages}
    f_stage, b_stage = stages[forward.stage_index], stages[backward.stage_index]
    f_mb, b_mb = forward.microbatch_index, backward.microbatch_index
    assert f_mb is not None and b_mb is not None and ctx.arg_mbs is not None
    # What torch's runtime does before F and before B (its step's closure, module docstring):
    # a chunk whose neighbour is on this rank was handed its input locally.
    runtime._assert_unsharded(f_stage)
    if not f_stage.is_first and f_stage.stage_index - 1 not in stages:
        _wait_received(runtime.fwd_recv_ops, action, f_stage.stage_index, f_mb)
    runtime._assert_unsharded(b_stage)
    if not b_stage.is_last and b_stage.stage_index + 1 not in stages:
        _wait_received(runtime.bwd_recv_ops, action, b_stage.stage_index, b_mb)
    loss = runtime._maybe_get_loss(b_stage, b_mb)
    runtime.backward_counter[b_stage.stage_index] += 1
    last_backward = runtime.backward_counter[b_stage.stage_index] == runtime._n_microbatches
    kwargs = ctx.kwarg_mbs[f_mb] if ctx.kwarg_mbs is not None else None
    enter = _callers_context(f_stage.device)

    def run_forward() -> Any:
        with enter():
            # PipelineSchedule never asks the runtime for the outputs (return_outputs=False).
            output = f_stage.forward_one_chunk(
                f_mb, ctx.arg_mbs[f_mb], kwargs, save_forward_output=False
            )
            runtime._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
            return output

    turns = _Turns(run_forward, f_stage.device)
    with all_to_all_in_flight(turns.switch):
        turns.start()
        try:
            b_stage.backward_one_chunk(
                b_mb, loss=loss, full_backward=True, last_backward=last_backward
            )
        finally:
            turns.finish()
    if turns.error is not None:
        raise turns.error
    if f_stage.stage_index + 1 in stages:
        stages[f_stage.stage_index + 1].set_local_fwd_input(turns.result, f_mb)
    if b_stage.stage_index - 1 in stages:
        stages[b_stage.stage_index - 1].set_local_bwd_input(
            b_stage.get_local_bwd_output(b_mb), b_mb
        )
