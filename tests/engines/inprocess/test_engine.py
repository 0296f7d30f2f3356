"""The in-process engine: thread state, failures, timeouts, debug mode."""

import threading
import time

import pytest
import torch
from torch import nn

import tensorshard as tp
from support import plans
from support.helpers import rel_err, split_copy
from support.models import FeedForward, Transformer

pytestmark = pytest.mark.timeout(60)


class Flaky(nn.Module):
    """A feed-forward applied twice; a shard can be told to fail (or stall) between the two."""

    def __init__(self):
        super().__init__()
        self.ff = FeedForward(8, 16)
        self.fail = False
        self.stall = 0.0

    def forward(self, x):
        y = self.ff(x)
        if self.fail:
            raise ValueError("failing on purpose")
        time.sleep(self.stall)
        return self.ff(y)


FLAKY_PLAN = {"ff.w[13]": tp.ColwiseParallel(), "ff.w2": tp.RowwiseParallel()}


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_failure_in_any_shard_reraises_naming_the_device(rank, gen):
    model = tp.tensor_parallel(Flaky(), ["cpu"] * 3, plan=FLAKY_PLAN)
    model.module_shards[rank].fail = True
    start = time.monotonic()
    with pytest.raises(ValueError, match="failing on purpose") as info:
        model(torch.randn(2, 8, generator=gen))
    assert time.monotonic() - start < 5
    assert f"cpu[{rank}] (rank {rank})" in " ".join(info.value.__notes__)
    # No shard is left waiting, and the model works for the next call.
    model.module_shards[rank].fail = False
    assert model(torch.randn(2, 8, generator=gen)).shape == (2, 8)
    assert not [t for t in threading.enumerate() if t.name.startswith("tensorshard") and _waiting(t)]


def _waiting(thread) -> bool:
    frame = __import__("sys")._current_frames().get(thread.ident)
    return frame is not None and "exchange" in repr(frame.f_code)


def test_a_stuck_shard_times_out_with_the_operation_named(gen):
    model = tp.tensor_parallel(Flaky(), ["cpu"] * 2, plan=FLAKY_PLAN, timeout=0.5)
    model.module_shards[1].stall = 2.0
    # Each shard owns its graph: copy_to_parallel meets the others in backward only, so the forward's second
    # collective is the all-reduce of the second pass.
    with pytest.raises(TimeoutError, match=r"all_reduce at ff.w2 \(collective #2\): device cpu\[1\] \(rank 1\) did not arrive"):
        model(torch.randn(2, 8, generator=gen, requires_grad=True))
    model.module_shards[1].stall = 0.0
    assert model(torch.randn(2, 8, generator=gen)).shape == (2, 8)


def test_thread_state_follows_the_caller(gen):
    model = split_copy(FeedForward(8, 16), 2, plan=plans.FEED_FORWARD)
    x = torch.randn(2, 8, generator=gen)
    with torch.no_grad():
        assert not model(x).requires_grad
    with torch.inference_mode():
        assert model(x).is_inference()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16
    assert model(x).requires_grad


def test_debug_mode_runs_one_device_serially_and_catches_plan_bugs(gen):
    ref = Transformer()
    model = split_copy(ref, 2, plan=plans.transformer(8, 2), debug=True)
    tokens = torch.randint(0, 96, (1, 5), generator=gen)
    assert rel_err(model(tokens), ref(tokens)) < 1e-5
    # A plan that forgets the head counts is refused before splitting (it would fail in the shards' reshapes).
    bad = {k: v for k, v in plans.transformer(8, 2).items() if k != "layers.*.attn"}
    bad = {k: (tp.ColwiseParallel() if "w[kv]" in k or "wq" in k else tp.RowwiseParallel() if "wo" in k else v) for k, v in bad.items()}
    with pytest.raises(ValueError, match=r"reads self.n_heads = 8 .* no Heads entry"):
        split_copy(Transformer(), 2, plan=bad, debug=True)
    # An error inside a shard names the shard.
    broken = split_copy(FeedForward(8, 16), 2, plan=plans.FEED_FORWARD, debug=True)
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        broken(torch.randn(2, 7, generator=gen))
    assert "rank" in " ".join(info.value.__notes__)


def test_debug_from_environment(monkeypatch):
    monkeypatch.setenv("TENSORSHARD_DEBUG", "1")
    assert split_copy(FeedForward(8, 16), 2, plan=plans.FEED_FORWARD).debug


def test_shards_cannot_run_outside_the_engine(gen):
    model = split_copy(FeedForward(8, 16), 2, plan=plans.FEED_FORWARD)
    with pytest.raises(Exception, match="outside the current call"):
        model.module_shards[1](torch.randn(2, 8, generator=gen))


def test_wrapping_twice_or_a_non_module_is_a_type_error():
    model = split_copy(FeedForward(8, 16), 2, plan=plans.FEED_FORWARD)
    with pytest.raises(TypeError, match="this TensorParallel is already split over"):
        tp.tensor_parallel(model, ["cpu"] * 2)
    with pytest.raises(TypeError, match="nn.Module"):
        tp.tensor_parallel(lambda x: x, ["cpu"])


def test_tensor_parallel_package_keywords(gen):
    ref = FeedForward(8, 16)
    model = split_copy(ref, 2, tensor_parallel_config=plans.FEED_FORWARD)
    assert model.tensor_parallel_config == plans.FEED_FORWARD
    x = torch.randn(2, 8, generator=gen)
    assert rel_err(model(x), ref(x)) < 1e-5
    with pytest.raises(ValueError, match="not both"):
        split_copy(ref, 2, plan=plans.FEED_FORWARD, tensor_parallel_config=plans.FEED_FORWARD)
