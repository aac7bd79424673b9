"""The decoder block at dp=2 × cp=2 × tp=2 (with sequence parallel) on 8 gloo ranks."""

from __future__ import annotations

import parallel_checks as checks
import pytest
from parallel_tolerances import assert_close

from mt_comm.testing import DistributedPool


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=8) as pool:
        yield pool


def test_decoder_block_dp2_cp2_tp2_sp(pool: DistributedPool) -> None:
    for result in pool.run(checks.decoder_lm, dp=2, cp=2, tp=2, sp=True):
        assert_close(result)
