"""Serial calls (engines/inprocess/schedule.py chose "one shard at a time"): the turn passes straight from one
shard to the next at every collective (comm/rendezvous.py `_Turns`), the numbers are bit-identical to running
the shards at the same time, and every failure still stops the call promptly with the device and operation named."""

import time

import pytest
import torch

from support import plans
from support.helpers import rel_err, split_copy
from support.models import TwoPairs
from support.workers_state import busy_workers
from tensorshard.comm import rendezvous
from tensorshard.engines.inprocess import schedule

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def way(monkeypatch):
    """Set how the next calls without gradients run: way(True) one shard at a time, way(False) all at once."""

    def choose(serial: bool) -> None:
        monkeypatch.setattr(schedule.Schedule, "serial", lambda self, key: serial)

    return choose


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_decoding_step_is_bit_identical_one_shard_at_a_time_and_all_at_once(n, way):
    from transformers import DynamicCache

    from support import tiny_llama

    ref = tiny_llama.build()
    model = split_copy(ref, n)
    prompt = torch.randint(0, tiny_llama.VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    steps = {}
    for serial in (True, False):
        way(serial)
        with torch.no_grad():
            out = model(input_ids=prompt, cache=DynamicCache(), use_cache=True)
            logits = [out.logits]
            for _ in range(4):  # greedy steps, each through the cache this way filled
                token = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=token, cache=out.past_key_values, use_cache=True)
                logits.append(out.logits)
        steps[serial] = logits
    assert all(torch.equal(a, b) for a, b in zip(steps[True], steps[False]))
    with torch.no_grad():
        assert rel_err(steps[True][0], ref(prompt).logits) < 1e-5  # fp32 sums in another order


@pytest.mark.parametrize("n", [2, 3])
def test_each_hand_off_wakes_exactly_one_shard(n, way, gen, monkeypatch):
    """One hand-off per shard that is not last at a collective, and one per shard that returns but the last:
    no shard is woken to find it is not its turn."""
    model = split_copy(TwoPairs().eval(), n, plan=plans.TWO_BLOCKS)
    given = []
    give = rendezvous._Turns.give
    monkeypatch.setattr(rendezvous._Turns, "give", lambda self, rank: (given.append(rank), give(self, rank)))
    way(True)
    with torch.no_grad():
        model(torch.randn(4, 8, generator=gen))
    collectives = 2  # the all-reduces of b1 and b2
    assert len(given) == (collectives + 1) * (n - 1)


def _misbehave(model, rank: int, how: str):
    """Make shard `rank` fail as `how` says; returns what undoes it."""
    shard = model.module_shards[rank]

    def fail(*_):
        raise ValueError("shard failed on purpose")

    if how == "returns early":
        kept = shard.b2.forward
        shard.b2.forward = lambda h: torch.zeros(h.shape[0], 8)  # never reaches b2's all-reduce
        return lambda: setattr(shard.b2, "forward", kept)
    hook = {
        "raises": (shard.b1, fail),
        "stalls": (shard.b2, lambda *_: time.sleep(1.5)),
        "other shape": (shard.a2, lambda module, args: (args[0][:1],)),  # (1, 8) would broadcast against (4, 8)
    }[how]
    return hook[0].register_forward_pre_hook(hook[1]).remove


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize(
    "how, error, match",
    [
        ("raises", ValueError, "shard failed on purpose"),
        ("returns early", RuntimeError, r"all_reduce at b2 \(collective #2\).*\(rank {rank}\) \(1 collective\(s\)\) returned without reaching it"),
        ("stalls", TimeoutError, r"all_reduce at b2 \(collective #2\): device cpu\[{rank}\] \(rank {rank}\) did not arrive within 0.4 s"),
        ("other shape", RuntimeError, r"differs between shards"),
    ],
)
def test_a_failing_shard_stops_a_serial_call_promptly_and_the_model_stays_usable(rank, how, error, match, way, gen):
    ref = TwoPairs().eval()
    model = split_copy(ref, 3, plan=plans.TWO_BLOCKS, timeout=0.4)
    undo = _misbehave(model, rank, how)
    way(True)
    start = time.monotonic()
    with pytest.raises(error, match=match.format(rank=rank)):
        with torch.no_grad():
            model(torch.randn(4, 8, generator=gen))
    assert time.monotonic() - start < 3
    undo()
    deadline = time.monotonic() + 5  # a stalled shard wakes up, meets its ended call, and stops
    while busy_workers(model) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert busy_workers(model) == []
    x = torch.randn(4, 8, generator=gen)
    for serial in (True, False):
        way(serial)
        with torch.no_grad():
            assert rel_err(model(x), ref(x)) < 1e-5
