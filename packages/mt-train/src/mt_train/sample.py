"""Greedy decoding without a KV cache: ``x_{t+1} = argmax_v logits(x_{≤t})[v]``.

Each new token re-runs the model on the last ``max_seq_len`` tokens; at the default run's
sizes (a 1M-parameter model, 160 tokens) that costs about a second on a CPU and keeps the
model free of inference-only code.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    max_seq_len: int,
    device: torch.device,
) -> list[int]:
    """``prompt_ids`` followed by ``max_new_tokens`` greedily chosen ids."""
    if not prompt_ids:
        raise ValueError("the sample prompt encodes to no tokens")
    was_training = model.training
    model.eval()
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-max_seq_len:]], dtype=torch.long, device=device)
        logits = model(context)
        ids.append(int(logits[0, -1].argmax()))
    model.train(was_training)
    return ids
