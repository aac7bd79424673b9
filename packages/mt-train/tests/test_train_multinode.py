"""Two torchrun "nodes" on this machine: ``mt_train`` with data parallelism across them,
checkpoints from both, and a second launch that resumes with ``checkpoint.resume=auto``.

Each node is its own ``torchrun --nnodes 2 --nproc-per-node 1`` agent; they meet through a
c10d rendezvous on a free localhost port (node 0 hosts the store), exactly as two machines
would through ``--rdzv-endpoint host:port`` (``docs/multi_node.md``). The world is two CPU
ranks on gloo, dp=2. The split run (8 steps, then a relaunch to 12) must log the same losses,
step for step and bit for bit, as one uninterrupted 12-step launch: the resumed ranks restored
both shards of the step-8 checkpoint (model, AdamW state, RNG, sampler position).

Every launch has a timeout; on expiry both agents' process groups are killed, so a hung
rendezvous or collective fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from train_checks import tiny_overrides

from mt_train.rewind import read_events

LAUNCH_TIMEOUT_S = 240
"""Per launch of both nodes; one takes about 15 s on two loaded CPU cores."""


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


def test_two_nodes_train_checkpoint_and_resume(kjv_data: Path, tmp_path: Path) -> None:
    common = {
        "trainer.device": "cpu",  # gloo; two "nodes" on one GPU would collide on cuda:0
        "trainer.log_interval": 1,
        "trainer.eval_interval": 4,
        "scheduler": "constant",  # stopping at step 8 must not change the LR curve
    }
    full, split = tmp_path / "full", tmp_path / "split"
    _launch_two_nodes(tiny_overrides(kjv_data, **common, **{"trainer.max_steps": 12}), full)
    _launch_two_nodes(tiny_overrides(kjv_data, **common, **{"trainer.max_steps": 8}), split)
    step8 = split / "checkpoints" / "step-00000008"
    assert sorted(p.name for p in step8.glob("rank-*.safetensors")) == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]  # one shard from each node
    manifest = json.loads((step8 / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["parallel"]["dp"] == 2
    assert sorted(_train_losses(split)) == list(range(1, 9))

    resume = {"trainer.max_steps": 12, "checkpoint.resume": "auto"}
    _launch_two_nodes(tiny_overrides(kjv_data, **common, **resume), split)
    (event,) = [e for e in read_events(split) if e["event"] == "resume"]
    assert event["step"] == 8 and Path(event["path"]).name == step8.name

    expected, resumed = _train_losses(full), _train_losses(split)
    assert sorted(resumed) == list(range(1, 13))
    assert resumed == expected  # exact, every step: steps 9-12 continue the same curve
