"""What the GPU tests (tests/gpu) share: marks that skip them by the number of visible GPUs, and the device
lists one GPU reaches.

A GPU may appear once in a device list, so one GPU reaches the multi-device paths only beside CPU slots: the
GPU alone, first (outputs land on the first device), last, and beside two CPU slots. Every test here carries
the `gpu` mark (`pytest -m gpu` runs them all) and is collected, then skipped, on a machine without GPUs.
"""

from __future__ import annotations

import pytest
import torch


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


ONE_GPU = [pytest.mark.gpu, pytest.mark.skipif(visible_gpus() < 1, reason="needs a GPU")]
TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(visible_gpus() < 2, reason="needs 2 GPUs")]

WITH_ONE_GPU = [["cuda:0"], ["cuda:0", "cpu"], ["cpu", "cuda:0"], ["cuda:0", "cpu", "cpu"]]
WITH_ONE_GPU_IDS = ["gpu", "gpu+cpu", "cpu+gpu", "gpu+2cpu"]


def devices_of(module: torch.nn.Module) -> set[torch.device]:
    return {t.device for t in list(module.parameters()) + list(module.buffers())}


def assert_on_their_devices(model, devices: list[str]) -> None:
    """Every shard's parameters and buffers live on the device of its slot, and only there."""
    for shard, device in zip(model.module_shards, devices):
        want = torch.device(device)
        assert {(d.type, d.index or 0) for d in devices_of(shard)} == {(want.type, want.index or 0)}, (device, devices_of(shard))
