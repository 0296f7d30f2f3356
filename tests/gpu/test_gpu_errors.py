"""Errors on a GPU machine: a device list naming a GPU that is not there, or listing one GPU twice, is refused
before anything changes; a GPU too full for its shard fails the split with CUDA's out-of-memory error and a note
that the original model was restored, which then splits once memory is free."""

import copy

import pytest
import torch

import tensorshard as tp
from support import plans
from support.gpu import ONE_GPU, visible_gpus
from support.models import FeedForward
from support.workers_state import assert_unchanged, snapshot

pytestmark = ONE_GPU + [pytest.mark.timeout(300)]


def test_a_gpu_that_is_not_visible_is_refused_by_name():
    count = visible_gpus()
    model = FeedForward(16, 32)
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"'cuda:{count}' does not exist: {count} cuda device\(s\) are visible"):
        tp.tensor_parallel(model, ["cuda:0", f"cuda:{count}"], plan=plans.FEED_FORWARD)
    with pytest.raises(ValueError, match=r"lists a device more than once \(cuda:0 at positions \[0, 1\]\)"):
        tp.tensor_parallel(model, ["cuda:0", "cuda:0"], plan=plans.FEED_FORWARD)  # a GPU appears once
    assert_unchanged(model, before)


def _fill(device: str, leave: int) -> list[torch.Tensor]:
    """Allocate the GPU's free memory but about `leave` bytes, in blocks (one block might not fit anywhere)."""
    torch.cuda.empty_cache()
    blocks, block = [], 1 << 30
    while block >= 1 << 20:
        free, _ = torch.cuda.mem_get_info(device)
        if free - block < leave:
            block //= 2
            continue
        try:
            blocks.append(torch.empty(block, dtype=torch.uint8, device=device))
        except torch.cuda.OutOfMemoryError:
            block //= 2
    return blocks


def test_a_full_gpu_fails_the_split_and_leaves_the_model_as_it_was(gen):
    """Each shard of this model needs 128 MiB on its device; the GPU keeps 32 MiB free."""
    torch.manual_seed(0)
    model = FeedForward(4096, 8192)  # 3 x 128 MiB of fp32 weights: 192 MiB per device at 2 devices
    ref = copy.deepcopy(model)
    before = snapshot(model)
    filler = _fill("cuda:0", leave=32 << 20)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError) as info:
            tp.tensor_parallel(model, ["cuda:0", "cpu"], plan=plans.FEED_FORWARD)
    finally:
        del filler
        torch.cuda.empty_cache()
    assert "the original model was restored" in " ".join(getattr(info.value, "__notes__", []))
    assert_unchanged(model, before)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    split = tp.tensor_parallel(model, ["cuda:0", "cpu"], plan=plans.FEED_FORWARD)
    x = torch.randn(2, 4096, generator=gen)
    with torch.no_grad():
        assert torch.allclose(split(x).cpu(), ref(x), rtol=1e-4, atol=1e-5)
