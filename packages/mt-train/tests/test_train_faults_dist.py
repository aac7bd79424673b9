"""Two gloo ranks: an error that only rank 0 can see (the run folder locked by a live
process) stops both ranks, rank 1 with :class:`~mt_train.errors.RankZeroError` (which the CLI
does not print twice); a damaged data folder stops both with the same line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import cli_checks
import pytest
from cli_checks import small_data
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.run_lock import LOCK_FILE, process_start


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


def test_start_errors_stop_every_rank(pool, tmp_path: Path) -> None:
    data = small_data(tmp_path / "data")
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = {"pid": holder.pid, "host": socket.gethostname(), "start": process_start(holder.pid)}
        (out / LOCK_FILE).write_text(json.dumps(lock))
        results = pool.run(cli_checks.start_error, tiny_overrides(data), out)
    finally:
        holder.kill()
        holder.wait()
    assert [kind for kind, _ in results] == ["RunLockedError", "RankZeroError"]
    assert results[0][1] == results[1][1] and f"pid {holder.pid}" in results[0][1]

    (data / "val.idx").unlink()
    results = pool.run(cli_checks.start_error, tiny_overrides(data), tmp_path / "other")
    assert [kind for kind, _ in results] == ["DataError", "DataError"]
    assert "val.idx' is missing" in results[1][1]
