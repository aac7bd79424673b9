"""Two ranks through the third-party ``fakeaccel`` device and its ``fakeccl`` backend."""

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
