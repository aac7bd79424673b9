"""The vision-language model under the sharded data-parallel modes on two gloo ranks (dp=2):
FSDP2 (both towers' blocks, the projector and the decoder sharded over the ranks) and ZeRO-1
(AdamW's moments sharded) train the digits captions as one process does, step by step, and
end with its weights up to fp32 summation order (their step-8 checkpoints, the pieces
joined, against one process's); an FSDP2 checkpoint resumes exactly. A pool shared across
modules; the reference runs in this process (DDP and TP: test_train_vlm_parallel.py; rewind:
test_train_vlm_rewind.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_checks
from test_train_vlm_parallel import NO_DROPOUT, RTOL, vlm_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.checkpoint.checkpointer import ELEMS, read_whole
from mt_train.checkpoint.files import CheckpointReader

pytest.importorskip("sklearn", reason="the vision extra: pip install 'mt-train[vision]'")

MODES = ("fsdp", "zero1")
STEPS, SPLIT = 8, 4
"""Checkpoints at steps 4 and 8 (vlm_overrides' interval): 8 ends the comparison of the
weights, 4 is where the FSDP2 run is resumed."""

# fp32: the modes differ from one process in the gradients' summation order (FSDP2's
# reduce-scatter, ZeRO-1's all-reduce), a few ulps per step. AdamW hands a relative change of
# a gradient on to its update, so after 8 steps the weights differ by a small multiple of the
# steps' relative gradient error, far below 1e-4 of each tensor's largest value; a shard
# reduced over the wrong ranks, updated from another shard's moments or restored in the wrong
# place moves its tensor by about the learning rate per step, well above the bound.
WEIGHTS_RTOL = 1e-4
NOISE_ONLY = "attention.k_proj.bias"
"""The encoder's attention key biases: softmax is invariant to adding ``q·b_k`` to every score
of a row, so their gradient is zero in exact arithmetic and rounding noise in fp32; AdamW's
normalised update turns that noise into steps of up to about the learning rate whose sign the
noise sets, so these weights differ between any two summation orders and are not compared."""


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


@pytest.fixture(scope="module")
def runs(pool: DistributedPool, digits: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process and each mode, dropout off (one process and dp ranks draw other masks)."""
    root = tmp_path_factory.mktemp("vlm_dp")
    out: dict = {"root": root}
    out["single"] = train_checks.run_losses(vlm_overrides(digits, **NO_DROPOUT), root / "single")
    for mode in MODES:
        overrides = vlm_overrides(digits, parallel=mode, **NO_DROPOUT)
        out[mode] = pool.run(train_checks.run_losses, overrides, root / mode)
    return out


def checkpoint(root: Path, step: int) -> Path:
    return root / "checkpoints" / f"step-{step:08d}"


def whole_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint, its pieces joined (a missing or
    overlapping piece raises)."""
    reader = CheckpointReader(folder)
    names = {ELEMS.sub("", n) for n in reader.names() if n.startswith(("model/", "optim/"))}
    return {name: read_whole(reader, name) for name in sorted(names)}


@pytest.mark.parametrize("mode", MODES)
def test_mode_trains_like_one_process(mode: str, runs: dict) -> None:
    ranks, single = runs[mode], runs["single"]
    assert ranks[0] == ranks[1]  # every rank reports the global mean loss
    assert len(single) == STEPS and single[-1] < single[0]
    assert ranks[0] == pytest.approx(single, rel=RTOL)

    saved = checkpoint(runs["root"] / mode, STEPS)
    manifest = (saved / "manifest.json").read_text()
    # Each rank wrote its pieces: FSDP2 shards the weights and moments of the encoder, the
    # projector and the decoder alike; ZeRO-1 the moments only.
    for name in ("vision.layers.0.mlp.fc1.weight", "projector.linear_1.weight",
                 "language.layers.0.attention.q_proj.weight"):  # fmt: skip
        assert f"optim/{name}/exp_avg@elems" in manifest
        assert (f"model/{name}@elems" in manifest) == (mode == "fsdp")
    got = whole_tensors(saved)
    expected = whole_tensors(checkpoint(runs["root"] / "single", STEPS))
    assert got.keys() == expected.keys()
    compared = [n for n in expected if n.startswith("model/") and NOISE_ONLY not in n]
    assert len(compared) > 40 and any(n.startswith("model/vision.") for n in compared)
    errors = {
        n: float((got[n] - expected[n]).abs().max() / expected[n].abs().max()) for n in compared
    }
    assert max(errors.values()) < WEIGHTS_RTOL, errors


def test_fsdp_checkpoint_resumes_exactly(pool: DistributedPool, runs: dict, digits: Path) -> None:
    root = runs["root"]
    resume = {"checkpoint.resume": str(checkpoint(root / "fsdp", SPLIT))}
    overrides = vlm_overrides(digits, parallel="fsdp", **NO_DROPOUT, **resume)
    resumed = pool.run(train_checks.run_losses, overrides, root / "fsdp-resumed")
    assert resumed[0] == resumed[1] == runs["fsdp"][0][SPLIT:]  # exact, step by step
    final = whole_tensors(checkpoint(root / "fsdp-resumed", STEPS))
    uninterrupted = whole_tensors(checkpoint(root / "fsdp", STEPS))
    assert final.keys() == uninterrupted.keys()
    assert [n for n, t in uninterrupted.items() if not torch.equal(final[n], t)] == []
