"""Activation memory of a pipeline schedule: measured bytes of autograd-saved tensors, and the
bytes the action lists predict.

What is measured (:class:`ActivationMeter`). Inside the meter a ``saved_tensors_hooks`` pair sees
every tensor autograd saves for backward on this thread, and on the thread DualPipeV's
overlapped forward runs on (:mod:`.overlap` runs it under the caller's saved-tensor hooks, as
torch's back-to-back ``F`` would). The meter also watches the sinks (``WeightGradSink``) it is
given: a closure queued there keeps the tensors its caller names (``defer(compute, holds=...)``:
the layer's input, ``dy``, their quantized forms) alive after autograd released them, until
``W`` has run it and it is freed. Each storage is charged once with its ``nbytes`` while it has a
user, a saved tensor not yet released or a queued closure not yet freed that holds it (a view
and its base, one input saved by three linears and held by their three closures, count once),
and storages of the excluded tensors (the chunks' parameters and buffers) are never counted.
A saved tensor is released when autograd drops it: after the node that saved it ran its
backward (a graph run without ``retain_graph``) or when the graph is freed. ``bytes`` is the
current total, ``peak`` its maximum; the counts are updated under a lock, so the two threads
of an overlapped pair (and finalizers running on either) keep them exact. Not counted:
tensors neither saved for backward nor held by a watched sink (a stage's output buffer
between actions, received activations before a forward saves them, gradients, temporaries
inside a backward, the optimizer), anything saved on a thread that did not enter the hooks,
and allocator overhead; so it is the activation memory a schedule controls, not the
process's.

What the schedule predicts (:func:`predicted_peak_bytes`). A rank's saved bytes change only
with its own actions: ``F`` of chunk ``s`` adds ``a_s`` (one micro-batch's forward through the
chunk, and the loss on the last chunk); a full backward ``B`` frees ``a_s``; an input-gradient
``I`` frees all but ``k_s``, what the weight gradient still needs, which its ``W`` frees. The
peak is the maximum of the running sum over the rank's list. With ``k_s = 0`` and one ``a`` for
every chunk of the rank it is ``a`` times :func:`mt_parallel.pipeline.simulate`'s
``peak_activations`` (in chunks), which counts ``F`` to ``I`` only. torch's split backward keeps
more after ``I``: on a first chunk its ``I`` does nothing (the input needs no gradient) and
``W`` runs the whole backward, so ``k_0 = a_0``; on other chunks ``I`` runs with the graph
retained and keeps the part the weight gradients need, which in a transformer block is every
saved tensor (each feeds some weight's gradient): only the loss's are freed at ``I``. So under
torch's split backward a zero-bubble rank holds its chunks from ``F`` to ``W`` (less the last
chunk's loss tensors): ZB-H1 then holds ``p`` chunks on every rank where the ``F``-to-``I``
count is ``p − r``; the most over ranks (rank 0's) is the same for every schedule and
``p ≤ 8`` of pipeline_bubbles.py. Where a sink splits the backward instead (FP8 layers, and
every layer with a sink on torch < 2.13), ``I`` runs the chunk's whole autograd backward and
``k_s`` is what the queued closures hold: every sink layer's input and ``dy``. During a
backward the bytes can rise above what it started with (a closure holds its ``dy`` before
the saved tensors of the nodes still to run are released): ``rise[s]``, the most chunk
``s``'s backward (``B`` or ``I``) adds above its start, counts on top of the running sum
there (zero where nothing is queued or recomputed: a backward then only releases). Measured
exactly on gloo, with torch's split, with sinks and with DualPipeV's overlapped pairs:
test_pipeline_world2.py.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

import mt_fp8
from mt_parallel.pipeline.schedules import Action, B, F, I, W, leaf_actions


class _Saved:
    """The object autograd keeps for one saved tensor; its release uncharges the storage."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Bytes of autograd-saved tensors alive on this thread (and on DualPipeV's overlap
    thread), and of tensors held by the closures queued in ``sinks``, while the meter is
    entered (module docstring). ``exclude``: tensors never counted (parameters, buffers)."""

    def __init__(
        self, exclude: Iterable[torch.Tensor] = (), sinks: Iterable[mt_fp8.WeightGradSink] = ()
    ) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._sinks = list(sinks)
        self._users: dict[int, int] = {}
        """Users alive per counted storage (its data pointer): saved tensors, queued closures."""
        self._sizes: dict[int, int] = {}
        self._lock = threading.RLock()  # re-entrant: a finalizer may run inside a charge
        self.bytes = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset_peak(self) -> None:
        self.peak = self.bytes

    def _charge(self, tensors: Iterable[torch.Tensor]) -> list[int]:
        """One more user for each counted storage among ``tensors`` (once per storage); the
        keys to release when that user goes."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        keys = [k for k, n in storages.items() if k not in self._excluded and n > 0]
        with self._lock:
            for key in keys:
                if key not in self._users:
                    self._users[key], self._sizes[key] = 0, storages[key]
                    self.bytes += storages[key]
                self._users[key] += 1
            self.peak = max(self.peak, self.bytes)
        return keys

    def _release(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                self._users[key] -= 1
                if self._users[key] == 0:
                    del self._users[key]
                    self.bytes -= self._sizes.pop(key)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor.detach())  # no grad_fn: no cycle through the saving node
        keys = self._charge([tensor])
        if keys:
            weakref.finalize(saved, self._release, keys)
        return saved

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _hold(self, compute: Callable[[], None], tensors: list[torch.Tensor]) -> None:
        """A sink queued ``compute``, which holds ``tensors`` until it is freed."""
        keys = self._charge(tensors)
        if keys:
            weakref.finalize(compute, self._release, keys)

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        for sink in self._sinks:
            sink.observers.append(self._hold)
        return self

    def __exit__(self, *exc: object) -> None:
        for sink in self._sinks:
            sink.observers.remove(self._hold)
        self._hooks.__exit__(*exc)


def predicted_peak_bytes(
    actions: Sequence[Action],
    saved: Mapping[int, float],
    kept: Mapping[int, float],
    rise: Mapping[int, float] | None = None,
) -> float:
    """The most saved bytes one rank holds running ``actions`` (its compute list), given per
    chunk ``saved[s]`` (one micro-batch's forward), ``kept[s]`` (what stays from ``I`` to
    ``W``) and ``rise[s]`` (the most its backward adds above its start; None: zero for every
    chunk); module docstring."""
    live = peak = 0.0
    for entry in actions:
        for action in leaf_actions(entry):
            s, kind = action.stage_index, action.computation_type
            if kind in (B, I) and rise is not None:
                peak = max(peak, live + rise[s])
            if kind == F:
                live += saved[s]
                peak = max(peak, live)
            elif kind == B:
                live -= saved[s]
            elif kind == I:
                live -= saved[s] - kept[s]
            elif kind == W:
                live -= kept[s]
    return peak
