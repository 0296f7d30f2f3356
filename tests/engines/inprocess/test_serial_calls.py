"""Serial calls (engines/inprocess/schedule.py chose "one shard at a time"): the turn passes straight from one
shard to the next at every collective (comm/rendezvous.py `_Turns`), the numbers are bit-identical to running
the shards at the same time, and every failure still stops the call promptly with the device and operation named."""

import threading
import time

import pytest
import torch

from support import plans
from support.helpers import rel_err, split_copy
from support.models import TwoPairs
from support.workers_state import set_timeout, wait_until_idle
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


def _misbehave(model, rank: int, how: str, released: threading.Event):
    """Make shard `rank` fail as `how` says ("stalls": until `released` is set); returns what undoes it."""
    shard = model.module_shards[rank]

    def fail(*_):
        raise ValueError("shard failed on purpose")

    if how == "returns early":
        kept = shard.b2.forward
        shard.b2.forward = lambda h: torch.zeros(h.shape[0], 8)  # never reaches b2's all-reduce
        return lambda: setattr(shard.b2, "forward", kept)
    hook = {
        "raises": (shard.b1, fail),
        "stalls": (shard.b2, lambda *_: released.wait()),
        "other shape": (shard.a2, lambda module, args: (args[0][:1],)),  # (1, 8) would broadcast against (4, 8)
    }[how]
    return hook[0].register_forward_pre_hook(hook[1]).remove


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize(
    "how, error, match",
    [
        ("raises", ValueError, "shard failed on purpose"),
        ("returns early", RuntimeError, r"all_reduce at b2 \(collective #2\).*\(rank {rank}\) \(1 collective\(s\)\) returned without reaching it"),
        ("stalls", TimeoutError, r"all_reduce at b2 \(collective #2\): device cpu\[{rank}\] \(rank {rank}\) did not arrive within 2 s"),
        ("other shape", RuntimeError, r"differs between shards"),
    ],
)
def test_a_failing_shard_stops_a_serial_call_promptly_and_the_model_stays_usable(rank, how, error, match, way, gen):
    """Promptly: a raising, early or misshapen shard ends the call with no timeout involved (the limit is 60 s, and
    the call must end in well under half of it). A stalled shard is held on an event until another shard has
    reported it (it may be the caller's own thread, which nothing can interrupt), after that call's limit (2 s: a
    loaded machine may hold a healthy shard back for a fraction of one)."""
    ref = TwoPairs().eval()
    model = split_copy(ref, 3, plan=plans.TWO_BLOCKS, timeout=60)
    released = threading.Event()
    undo = _misbehave(model, rank, how, released)
    way(True)
    if how == "stalls":
        set_timeout(model, 2)
        fail = model._group._fail  # where a shard's wait ends in an error: the stalled one is let go after it

        def reported(call, error):
            raised = fail(call, error)
            released.set()
            return raised

        model._group._fail = reported
    start = time.monotonic()
    try:
        with pytest.raises(error, match=match.format(rank=rank)):
            with torch.no_grad():
                model(torch.randn(4, 8, generator=gen))
        assert time.monotonic() - start < 30  # no timeout ended it (60 s), or only the stall call's (2 s)
    finally:
        released.set()
        set_timeout(model, 60)
        model._group.__dict__.pop("_fail", None)
    undo()
    wait_until_idle(model)  # a stalled shard wakes up, meets its ended call, and stops
    x = torch.randn(4, 8, generator=gen)
    for serial in (True, False):
        way(serial)
        with torch.no_grad():
            assert rel_err(model(x), ref(x)) < 1e-5
