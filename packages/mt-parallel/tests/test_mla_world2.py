"""Multi-head latent attention at tp=2 on 2 gloo ranks against one process in float64 (one pool
for the module): heads split, compressed projections replicated, YaRN on."""

from __future__ import annotations

import mla_checks
import pytest
from parallel_tolerances import FP64_VS_FP64, assert_close

from mt_comm.testing import DistributedPool


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=2) as pool:
        yield pool


@pytest.mark.parametrize("q_lora_rank", [None, 10], ids=["no-q-lora", "q-lora"])
def test_mla_tensor_parallel_equals_one_process(pool: DistributedPool, q_lora_rank) -> None:
    for result in pool.run(mla_checks.tp_parity, tp=2, q_lora_rank=q_lora_rank):
        # The replicated q_a/kv_a weights and the input need the TP sum of their gradients
        # (a missing reduction is an O(1) error; FP64_VS_FP64 is 1e-10).
        assert set(result["grads"]) >= {"kv_a_proj.weight", "kv_b_proj.weight", "o_proj.weight"}
        assert_close(result, FP64_VS_FP64)
