"""Each device holds only its slices; the unsplit copy is not kept."""

import pytest
import torch

import tensorshard as tp
from support import plans
from support.helpers import split_copy
from support.models import FeedForward, Transformer

pytestmark = pytest.mark.timeout(60)


def unsplit_bytes(model):
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def test_feed_forward_memory_is_a_quarter_at_four_devices():
    ref = FeedForward(256, 1024)
    memory = tp.memory_per_device(split_copy(ref, 4, plan=plans.FEED_FORWARD))
    assert list(memory) == ["cpu[0]", "cpu[1]", "cpu[2]", "cpu[3]"]
    assert max(memory.values()) <= 0.27 * unsplit_bytes(ref)


def test_replicated_parts_are_whole_on_every_device():
    ref = Transformer()
    memory = tp.memory_per_device(split_copy(ref, 2, plan=plans.transformer(8, 2)))
    norms = sum(p.numel() * 4 for n, p in ref.named_parameters() if "norm" in n)
    split = unsplit_bytes(ref) - norms
    assert all(v == pytest.approx(split / 2 + norms, rel=0.01) for v in memory.values())


def test_original_module_is_consumed():
    model = FeedForward(16, 32)
    split = tp.tensor_parallel(model, ["cpu"] * 2, plan=plans.FEED_FORWARD)
    assert all(p.is_meta for p in model.parameters())  # no second copy kept alive
    with pytest.raises(RuntimeError, match="split over 2 device"):
        model(torch.randn(1, 16))
    assert split(torch.randn(1, 16)).shape == (1, 16)


def test_plain_module_memory_is_grouped_by_device():
    assert tp.memory_per_device(FeedForward(4, 8)) == {"cpu": 3 * 4 * 8 * 4}
