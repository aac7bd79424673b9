"""Activation memory of a pipeline schedule: measured bytes of autograd-saved tensors, and the
bytes the action lists predict.

What is measured (:class:`ActivationMeter`). Inside the meter a ``saved_tensors_hooks`` pair sees
every tensor autograd saves for backward on this thread. Each saved tensor is charged once per
storage: a storage is counted with its ``nbytes`` from its first saved tensor until autograd
releases the last saved tensor using it (a view and its base, or one input saved by three
linears, count once), and storages of the excluded tensors (the chunks' parameters and
buffers) are never counted. A saved tensor is released when autograd drops it: after the node
that saved it ran its backward (a graph run without ``retain_graph``) or when the graph is
freed. ``bytes`` is the current total, ``peak`` its maximum. Not counted: tensors that are not
saved for backward (a stage's output buffer between actions, received activations before a
forward saves them, gradients, temporaries inside a backward, the optimizer), tensors a
backward hands to something else after autograd released them (an FP8 layer's inputs queued
in a ``WeightGradSink`` until ``W``), anything saved on another thread (DualPipeV's overlapped
forward runs on one of its own: :mod:`.overlap`) and allocator overhead; so it is the
activation memory a schedule controls, not the process's.

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
``p ≤ 8`` of pipeline_bubbles.py. Measured exactly on gloo: test_pipeline_world2.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch

from mt_parallel.pipeline.schedules import Action, B, F, I, W, leaf_actions


class _Saved:
    """The object autograd keeps for one saved tensor; its release uncharges the storage."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Bytes of autograd-saved tensors alive on this thread while the meter is entered
    (module docstring). ``exclude``: tensors never counted (parameters, buffers)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._users: dict[int, int] = {}
        """Saved tensors alive per counted storage (its data pointer)."""
        self._sizes: dict[int, int] = {}
        self.bytes = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset_peak(self) -> None:
        self.peak = self.bytes

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        saved = _Saved(tensor.detach())  # no grad_fn: no cycle through the saving node
        if key in self._excluded or storage.nbytes() == 0:
            return saved
        if key not in self._users:
            self._users[key], self._sizes[key] = 0, storage.nbytes()
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        self._users[key] += 1
        weakref.finalize(saved, self._release, key)
        return saved

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: int) -> None:
        self._users[key] -= 1
        if self._users[key] == 0:
            del self._users[key]
            self.bytes -= self._sizes.pop(key)

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def predicted_peak_bytes(
    actions: Sequence[Action], saved: Mapping[int, float], kept: Mapping[int, float]
) -> float:
    """The most saved bytes one rank holds running ``actions`` (its compute list), given per
    chunk ``saved[s]`` (one micro-batch's forward) and ``kept[s]`` (what stays from ``I`` to
    ``W``); module docstring."""
    live = peak = 0.0
    for entry in actions:
        for action in leaf_actions(entry):
            s, kind = action.stage_index, action.computation_type
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
