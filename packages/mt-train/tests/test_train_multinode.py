"""Two torchrun "nodes" on this machine: ``mt_train`` with data parallelism across them,
checkpoints from both, and a second launch that resumes with ``checkpoint.resume=auto``.

Each node is its own ``torchrun --nnodes 2 --nproc-per-node 1`` agent; they meet through a
c10d rendezvous on a free localhost port (node 0 hosts the store), exactly as two machines
would through ``--rdzv-endpoint host:port`` (``docs/multi_node.md``). The world is two CPU
ranks on gloo, dp=2. The uninterrupted 12-step run that saves every 4 steps is the same job on
the session's 2-rank gloo pool (dp=2 as well; a launch of two agents costs their imports of
torch and mt_train, seconds each, where the pool's ranks have them already). The two-node
launch, in a run folder holding only that run's step-8 checkpoint, must log the same losses
for steps 9 to 12, bit for bit: the resumed ranks restored both shards of that checkpoint
(model, AdamW state, RNG, sampler position). Its own step-12 checkpoint, one shard from each
node, must hold the same bytes as the uninterrupted run's: the two nodes saved their state as
one process group of one machine does.

Every launch has a timeout; on expiry both agents' process groups are killed, so a hung
rendezvous or collective fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import train_checks
from train_checks import tiny_overrides

from mt_comm.testing import DistributedPool, PoolCache
from mt_train.rewind import read_events

LAUNCH_TIMEOUT_S = 240
"""Per launch of both nodes; one takes about 15 s on two loaded CPU cores."""
SHARDS = ["rank-00000.safetensors", "rank-00001.safetensors"]


@pytest.fixture(scope="module")
def pool(distributed_pools: PoolCache) -> DistributedPool:
    return distributed_pools.get(world_size=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_nodes(overrides: list[str], out: Path) -> None:
    """Run ``python -m mt_train`` on two torchrun agents of one rendezvous; both must exit 0."""
    port, rdzv_id = _free_port(), f"mt-multinode-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = []
    for node in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=120",
            "-m", "mt_train", *overrides, f"trainer.output_dir={out}", f"hydra.run.dir={out}",
        ]  # fmt: skip
        agents.append(
            subprocess.Popen(
                command,
                cwd=out.parent,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # one process group per agent and its worker
            )
        )
    try:
        outputs = [agent.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for agent in agents]
    finally:  # on a timeout (or any error) no agent or worker outlives the test
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    for node, (agent, text) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"node {node} exited {agent.returncode}:\n{text[-3000:]}"


def _train_losses(out: Path) -> dict[int, float]:
    """Step -> training loss, from the run folder's ``metrics.jsonl`` (a resume appends)."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_two_nodes_train_checkpoint_and_resume(
    pool: DistributedPool, kjv_data: Path, tmp_path: Path
) -> None:
    common = {
        "trainer.device": "cpu",  # gloo; two "nodes" on one GPU would collide on cuda:0
        "trainer.log_interval": 1,
        "trainer.eval_interval": 4,
        "scheduler": "constant",  # stopping at step 8 must not change the LR curve
    }
    full, split = tmp_path / "full", tmp_path / "split"
    pool.run(
        train_checks.run_losses, tiny_overrides(kjv_data, **common, **{"trainer.max_steps": 12}),
        full,
    )  # fmt: skip
    step8 = full / "checkpoints" / "step-00000008"
    assert sorted(p.name for p in step8.glob("rank-*.safetensors")) == SHARDS  # one per rank
    manifest = json.loads((step8 / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["parallel"]["dp"] == 2
    expected = _train_losses(full)
    assert sorted(expected) == list(range(1, 13))

    # The run stopped after step 8, as far as the relaunch can tell: only step-8 is on disk.
    shutil.copytree(step8, split / "checkpoints" / step8.name)
    resume = {"trainer.max_steps": 12, "checkpoint.resume": "auto"}
    _launch_two_nodes(tiny_overrides(kjv_data, **common, **resume), split)
    (event,) = [e for e in read_events(split) if e["event"] == "resume"]
    assert event["step"] == 8 and Path(event["path"]).name == step8.name

    resumed = _train_losses(split)
    assert sorted(resumed) == list(range(9, 13))
    # exact, every step: steps 9-12 continue the same curve
    assert resumed == {step: expected[step] for step in range(9, 13)}

    step12 = split / "checkpoints" / "step-00000012"
    assert sorted(p.name for p in step12.glob("rank-*.safetensors")) == SHARDS  # one per node
    manifest = json.loads((step12 / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["parallel"]["dp"] == 2
    for shard in SHARDS:
        saved = (full / "checkpoints" / step12.name / shard).read_bytes()
        assert (step12 / shard).read_bytes() == saved, shard
