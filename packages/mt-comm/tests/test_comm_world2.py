"""Two ranks through the third-party ``fakeaccel`` device and its ``fakeccl`` backend, and the
environment a pool hands its ranks."""

from __future__ import annotations

import importlib.util

import comm_checks
import pytest
import torch

from mt_comm.testing import DistributedPool
from mt_core.testing import require_test_fixture


@pytest.fixture(scope="module")
def fake_pool():
    require_test_fixture(
        importlib.util.find_spec("mt_fakeaccel") is not None,
        "the test plugin mt-fakeaccel",
        "pip install packages/mt-core/tests/fake_plugin (nox installs it)",
    )
    # device/backend "auto": the plugin must win auto-detection by itself. Not from
    # distributed_pools: no other module runs on this device and environment.
    with DistributedPool(
        world_size=2, device="auto", backend="auto", env={"MT_FAKEACCEL_AVAILABLE": "1"}
    ) as pool:
        yield pool


def test_third_party_device_and_backend_train_a_model(fake_pool: DistributedPool) -> None:
    results = fake_pool.run(comm_checks.fake_plugin_training, steps=30)
    for result in results:
        assert result["device"] == "fakeaccel"
        assert result["backend"] == "fakeccl"
        assert result["torch_backend"] == "fakeccl"
        assert result["groups_created"] >= 1  # torch built the group through the plugin
    # Gradients were averaged, so both replicas stay identical and the loss falls.
    assert torch.equal(results[0]["weight"], results[1]["weight"])
    losses = results[0]["losses"]
    assert losses == results[1]["losses"]
    assert losses[-1] < 0.05 * losses[0]


def test_ranks_get_the_environment_the_test_process_had_at_their_pool_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ranks are forked from a server that keeps the environment of the first pool start:
    # what changed since must still reach them.
    monkeypatch.setenv("MT_TEST_REMOVED_LATER", "1")
    with DistributedPool(world_size=2):  # the fork server runs from here on
        pass
    monkeypatch.delenv("MT_TEST_REMOVED_LATER")
    monkeypatch.setenv("MT_TEST_SET_LATER", "1")
    with DistributedPool(world_size=2, env={"MT_TEST_POOL_ENV": "2"}) as pool:
        states = pool.run(comm_checks.process_state)
    for rank, state in enumerate(states):
        environ = state["environ"]
        assert "MT_TEST_REMOVED_LATER" not in environ
        assert environ["MT_TEST_SET_LATER"] == "1"
        assert environ["MT_TEST_POOL_ENV"] == "2"
        assert environ["RANK"] == str(rank)
        assert environ["OMP_NUM_THREADS"] == "1"
