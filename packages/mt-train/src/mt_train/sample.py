"""Greedy decoding without a KV cache: ``x_{t+1} = argmax_v logits(x_{≤t})[v]``, at any layout.

Each new token re-runs the model on the last ``max_seq_len`` tokens; at the default run's
sizes (a 1M-parameter model, 160 tokens) that costs about a second on a CPU and keeps the
model free of inference-only code.

Parallel layouts. Every rank runs every forward (TP, CP and FSDP2 layers communicate) and
ends with the same ids:

* the context of ``n`` tokens is right-padded to ``N``, a multiple of ``2·cp`` (two chunks per
  CP rank) and, under sequence parallelism, of ``cp·tp``; causal attention never lets a real
  token see the padding after it, so the logits at positions ``< n`` do not change;
* under CP each rank runs its load-balanced part of the padded context at its global
  positions (``mt_parallel.shard_sequence``); the rank holding position ``n − 1`` contributes
  that row of logits and a SUM all-reduce over cp (zeros elsewhere, so exact) gives it to all;
* under TP the row is this rank's vocabulary slice ``V/tp``; an all-gather over tp joins the
  slices in rank order, and every rank takes the argmax of the same full row.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import mt_comm
import mt_parallel


def _size(group: Any) -> int:
    return 1 if group is None else mt_comm.group_size(group)  # mt_comm reads None as the world


def padded_length(n: int, cp: int, tp: int, sequence_parallel: bool) -> int:
    """The smallest ``N ≥ n`` that the layout can split (module docstring)."""
    multiple = math.lcm(2 * cp if cp > 1 else 1, cp * tp if sequence_parallel else 1)
    return -(-n // multiple) * multiple


@torch.no_grad()
def last_logits(
    model: nn.Module,
    ids: list[int],
    device: torch.device,
    tp_group: Any = None,
    cp_group: Any = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """The full-vocabulary logits ``(V,)`` after the last of ``ids``, on every rank."""
    cp, tp = _size(cp_group), _size(tp_group)
    n = len(ids)
    length = padded_length(n, cp, tp, sequence_parallel)
    tokens_1N = torch.tensor([ids + [ids[-1]] * (length - n)], dtype=torch.long, device=device)
    cp_rank = 0 if cp_group is None else mt_comm.group_rank(cp_group)
    positions_t = mt_parallel.load_balanced_positions(length, cp, cp_rank).to(device)
    logits_1tV_l = model(mt_parallel.shard_sequence(tokens_1N, 1, cp_group), positions_t)
    here = (positions_t == n - 1).nonzero()
    if here.numel():
        row_V_l = logits_1tV_l[0, int(here[0, 0])].float()
    else:
        row_V_l = logits_1tV_l.new_zeros(logits_1tV_l.shape[-1], dtype=torch.float32)
    if cp > 1:
        mt_comm.all_reduce(row_V_l, group=cp_group)
    return mt_comm.all_gather(row_V_l, group=tp_group) if tp > 1 else row_V_l


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    max_seq_len: int,
    device: torch.device,
    tp_group: Any = None,
    cp_group: Any = None,
    sequence_parallel: bool = False,
) -> list[int]:
    """``prompt_ids`` followed by ``max_new_tokens`` greedily chosen ids (every rank calls it
    with the same arguments and gets the same ids)."""
    if not prompt_ids:
        raise ValueError("the sample prompt encodes to no tokens")
    was_training = model.training
    model.eval()
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits_V = last_logits(
            model, ids[-max_seq_len:], device, tp_group, cp_group, sequence_parallel
        )
        ids.append(int(logits_V.argmax()))
    model.train(was_training)
    return ids
